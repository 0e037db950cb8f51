"""What the edge's DNS responder refuses to trust: rebinding answers and tunnelling names.

Two classes of attack turn an allowed name against the platform:

- **Rebinding.** An allowed name (a wildcard especially) whose upstream answer points at
  the metadata range, the host's loopback, a sibling sandbox or another private range
  would put that address into the sandbox's allow set. :func:`screen` drops every answer
  in :data:`BLOCKED_NETWORKS` before it reaches the set, unless a static rule of the same
  sandbox (a raw IP rule, or a service's CIDRs such as ``"metadata"``) covers it: the
  exception is spelled in the rule language the sandbox already uses.
- **Tunnelling.** Query names under an allowed wildcard reach the zone's authoritative
  servers, so data can ride out in them. :class:`TunnelGuard` bounds what one sandbox
  can send: a query-rate token bucket, label/name length and depth limits, and a
  per-zone budget of *new* names per window in which names that look like encoded data
  cost more.

Everything here keeps bounded state per sandbox whatever the agent sends, and takes a
clock so that the unit tests need no sleeping.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

Clock = Callable[[], float]
IPv4 = ipaddress.IPv4Address
Net4 = ipaddress.IPv4Network

# IANA special-purpose IPv4 space (RFC 6890 and successors) plus the sandbox range. An
# explicit list, not ``is_global``: its meaning has changed between Python releases, and
# multicast counts as "global" there.
BLOCKED_NETWORKS: tuple[Net4, ...] = tuple(
    Net4(n)
    for n in (
        "0.0.0.0/8",  # "this network", unspecified
        "10.0.0.0/8",  # RFC 1918
        "100.64.0.0/10",  # CGNAT, holds every edge's sandbox range (100.64.0.0/12)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, cloud metadata
        "172.16.0.0/12",  # RFC 1918
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # TEST-NET-1
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
        "192.168.0.0/16",  # RFC 1918
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # TEST-NET-2
        "203.0.113.0/24",  # TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address
    )
)


# Per prefix length, the blocked networks' leading bits: a lookup per length instead of
# a containment test per network (this runs for every answered address).
_BLOCKED_PREFIXES: tuple[tuple[int, frozenset[int]], ...] = tuple(
    (32 - length, frozenset(int(n.network_address) >> (32 - length) for n in nets))
    for length in sorted({n.prefixlen for n in BLOCKED_NETWORKS})
    for nets in [[n for n in BLOCKED_NETWORKS if n.prefixlen == length]]
)


def blocked(ip: IPv4) -> bool:
    """Whether an answer address points somewhere no public name should lead."""
    value = int(ip)
    return any(value >> shift in heads for shift, heads in _BLOCKED_PREFIXES)


@dataclass(frozen=True)
class Screened:
    """An upstream answer split by :func:`screen`."""

    kept: list[IPv4]  # may enter the allow set
    covered: list[IPv4]  # blocked range, but a static rule of the sandbox allows it
    dropped: list[IPv4]  # never leaves the edge


def screen(addresses: Iterable[IPv4], exempt: Sequence[Net4]) -> Screened:
    """Split ``addresses``: public ones are kept, blocked ones are dropped unless one of
    the sandbox's static networks ``exempt`` covers them (those are answered, but the
    static rule alone decides their ports, so they never widen the allow set)."""
    kept: list[IPv4] = []
    covered: list[IPv4] = []
    dropped: list[IPv4] = []
    for ip in addresses:
        if not blocked(ip):
            kept.append(ip)
        elif any(ip in net for net in exempt):
            covered.append(ip)
        else:
            dropped.append(ip)
    return Screened(kept, covered, dropped)


# -- tunnelling ------------------------------------------------------------------------------


class Reason(StrEnum):
    """Why a query was refused as (possible) tunnelling."""

    QUERY_RATE = "query_rate"
    MALFORMED_NAME = "malformed_name"
    LONG_LABEL = "long_label"
    LONG_NAME = "long_name"
    DEEP_NAME = "deep_name"
    UNIQUE_SUBDOMAINS = "unique_subdomains"


@dataclass(frozen=True)
class Limits:
    """The knobs; defaults leave honest package managers far below every limit."""

    query_rate: float = 50.0  # queries per second, sustained, per sandbox
    query_burst: float = 500.0
    max_label: int = 48  # characters of one label below an allowed wildcard
    max_subdomain: int = 128  # characters below an allowed wildcard
    max_depth: int = 4  # labels below an allowed wildcard
    window: float = 60.0  # seconds over which new names under a zone are budgeted
    zone_budget: int = 2048  # cost of new names per zone and window
    zone_names: int = 64  # distinct new names per zone and window
    data_cost: int = 4  # cost multiplier of a name with a label that looks like data
    data_label_len: int = 16  # ... a label at least this long
    data_label_bits: float = 3.5  # ... with at least this Shannon entropy per character


DEFAULT_LIMITS = Limits()
_LDH = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_")


def name_from_labels(labels: Sequence[bytes]) -> str | None:
    """The lower-case dotted name of a question, or None when any label is not plain
    letters/digits/hyphen/underscore of 1-63 bytes or the name exceeds 253 characters.
    Working on the wire labels (not dnslib's escaped text) keeps a label holding a dot
    or a NUL from impersonating an allowed name."""
    out: list[str] = []
    for raw in labels:
        label = raw.lower()
        if not 0 < len(label) <= 63 or not _LDH.issuperset(label):
            return None
        out.append(label.decode("ascii"))
    name = ".".join(out)
    return name if 0 < len(name) <= 253 else None


def entropy_bits(text: str) -> float:
    """Shannon entropy of ``text`` in bits per character."""
    if not text:
        return 0.0
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def looks_like_data(label: str, limits: Limits = DEFAULT_LIMITS) -> bool:
    """A long label with near-random characters: base32/hex/base64-ish payload."""
    return len(label) >= limits.data_label_len and entropy_bits(label) >= limits.data_label_bits


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; one per query."""

    def __init__(self, rate: float, burst: float, clock: Clock) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = burst
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class ZoneWindow:
    """New names seen under one allowed wildcard in the last ``window`` seconds. Holds
    at most ``zone_names`` entries: once the budget is spent, nothing more is added."""

    seen: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    spent: int = 0

    def expire(self, now: float, window: float) -> None:
        while self.seen:
            name, (stamp, cost) = next(iter(self.seen.items()))
            if now - stamp < window:
                return
            del self.seen[name]
            self.spent -= cost

    def admit(self, name: str, cost: int, now: float, limits: Limits) -> bool:
        self.expire(now, limits.window)
        if name in self.seen:
            return True  # a repeated lookup carries no new data
        if len(self.seen) >= limits.zone_names or self.spent + cost > limits.zone_budget:
            return False
        self.seen[name] = (now, cost)
        self.spent += cost
        return True


class TunnelGuard:
    """Per sandbox: may this query go on? ``admit`` returns None or the refusal reason."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.bucket = TokenBucket(limits.query_rate, limits.query_burst, clock)
        self.zones: dict[str, ZoneWindow] = {}  # keys: the policy's wildcard suffixes only
        self.refused: Counter[str] = Counter()

    def rate(self) -> Reason | None:
        """Charge one query to the bucket (every query, allowed name or not)."""
        return None if self.bucket.take() else self._refuse(Reason.QUERY_RATE)

    def name(self, name: str, zone: str | None) -> Reason | None:
        """Limits on the part of an allowed ``name`` below its wildcard ``zone`` (exact
        catalog names are fixed strings and carry nothing)."""
        if zone is None:
            return None
        sub = name[: -len(zone) - 1]
        labels = sub.split(".")
        lim = self.limits
        if any(len(label) > lim.max_label for label in labels):
            return self._refuse(Reason.LONG_LABEL)
        if len(sub) > lim.max_subdomain:
            return self._refuse(Reason.LONG_NAME)
        if len(labels) > lim.max_depth:
            return self._refuse(Reason.DEEP_NAME)
        cost = len(sub) * (lim.data_cost if any(looks_like_data(x, lim) for x in labels) else 1)
        window = self.zones.setdefault(zone, ZoneWindow())
        if not window.admit(sub, cost, self.clock(), lim):
            return self._refuse(Reason.UNIQUE_SUBDOMAINS)
        return None

    def malformed(self) -> Reason:
        return self._refuse(Reason.MALFORMED_NAME)

    def forget_zones(self, keep: Iterable[str]) -> None:
        """Drop the windows of wildcards the sandbox's new rules no longer allow."""
        keep = set(keep)
        for zone in [z for z in self.zones if z not in keep]:
            del self.zones[zone]

    def _refuse(self, reason: Reason) -> Reason:
        self.refused[reason] += 1
        return reason


class EventLimiter:
    """At most one event per key and ``interval`` seconds, so that an agent cannot flood
    the event stream; what was held back is counted into the next event of that key.
    Keys are bounded (``max_keys``, oldest forgotten first)."""

    def __init__(
        self, interval: float = 10.0, clock: Clock = time.monotonic, max_keys: int = 64
    ) -> None:
        self.interval, self.clock, self.max_keys = interval, clock, max_keys
        self.last: OrderedDict[str, float] = OrderedDict()
        self.held: Counter[str] = Counter()
        self.total: Counter[str] = Counter()

    def allow(self, key: str) -> tuple[bool, int]:
        """(emit now?, how many of this key were held back since the last one)."""
        now = self.clock()
        self.total[key] += 1
        stamp = self.last.get(key)
        if stamp is not None and now - stamp < self.interval:
            self.held[key] += 1
            return False, 0
        self.last[key] = now
        self.last.move_to_end(key)
        while len(self.last) > self.max_keys:
            old, _ = self.last.popitem(last=False)
            self.held.pop(old, None)
            self.total.pop(old, None)
        return True, self.held.pop(key, 0)
