"""The service catalog and the parsing of ``network_rules``.

``network_rules`` maps a key to allow (True) or not (False). A key is either

- a service name from the catalog (``"pypi"``, ``"npm"``, ``"github"``, ...): its host
  names are answered by the sandbox's DNS and the addresses they resolve to become
  reachable on the service's ports; its CIDRs are reachable on those ports at once; or
- a raw IPv4 rule: ``"10.1.2.3"``, ``"10.0.0.0/8"``, optionally with ports after a colon,
  ``"10.1.2.3:443"`` or ``"10.0.0.0/8:80,443,8000-8100"`` (no ports = every TCP/UDP port).

Two names are special: ``"host"`` lets the sandbox reach the host itself (every host
address, including the edge API's port) and ``"metadata"`` the link-local metadata range
169.254.0.0/16; both are denied unless allowed explicitly. ``False`` is the same as
leaving the key out: nothing is reachable unless a ``True`` rule allows it.

The shipped catalog (``DEFAULT_SERVICES``) is overridden entry by entry by a TOML or JSON
file named in ``DSEC_NETWORK_CATALOG``::

    [services.pypi]
    hosts = ["pypi.org", "files.pythonhosted.org"]
    ports = [443, 80]
    cidrs = []
    addresses = { "pypi.org" = ["10.0.0.5"] }   # optional static DNS answers (mirrors)

A host name ``"*.example.org"`` matches every name below example.org.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import InvalidArgument

PortRange = tuple[int, int]
ALL_PORTS: tuple[PortRange, ...] = ((0, 65535),)
WEB_PORTS: tuple[PortRange, ...] = ((443, 443), (80, 80))
HOST = "host"
METADATA = "metadata"
METADATA_CIDR = "169.254.0.0/16"

_IP_RULE_RE = re.compile(r"^(?P<net>[0-9.]+(?:/\d{1,2})?)(?::(?P<ports>[0-9,-]+))?$")
_HOST_RE = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9-]{1,63}\.?$")


@dataclass(frozen=True)
class Service:
    """What one service name opens: names (by DNS), networks, ports."""

    name: str
    hosts: tuple[str, ...] = ()
    cidrs: tuple[str, ...] = ()
    ports: tuple[PortRange, ...] = WEB_PORTS
    addresses: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _svc(name: str, hosts: list[str], ports: tuple[PortRange, ...] = WEB_PORTS) -> Service:
    return Service(name=name, hosts=tuple(hosts), ports=ports)


DEFAULT_SERVICES: dict[str, Service] = {
    s.name: s
    for s in (
        _svc("pypi", ["pypi.org", "files.pythonhosted.org", "pypi.python.org"]),
        _svc("npm", ["registry.npmjs.org", "registry.yarnpkg.com"]),
        _svc(
            "github",
            [
                "github.com",
                "api.github.com",
                "codeload.github.com",
                "objects.githubusercontent.com",
                "raw.githubusercontent.com",
                "*.githubusercontent.com",
            ],
            ((443, 443), (80, 80), (22, 22)),
        ),
        _svc("gitlab", ["gitlab.com", "*.gitlab.com"], ((443, 443), (80, 80), (22, 22))),
        _svc("debian", ["deb.debian.org", "security.debian.org", "*.debian.org"]),
        _svc("ubuntu", ["archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com"]),
        _svc("huggingface", ["huggingface.co", "*.huggingface.co", "*.hf.co"]),
        _svc("crates", ["crates.io", "index.crates.io", "static.crates.io"]),
        _svc("golang", ["proxy.golang.org", "sum.golang.org", "storage.googleapis.com"]),
        _svc("conda", ["conda.anaconda.org", "repo.anaconda.com"]),
        Service(name=METADATA, cidrs=(METADATA_CIDR,), ports=ALL_PORTS),
        Service(name=HOST, ports=ALL_PORTS),  # enforced on the host's input path
    )
}


def _ports(raw: Any, where: str) -> tuple[PortRange, ...]:
    out: list[PortRange] = []
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    for item in items:
        text = str(item).strip()
        lo, sep, hi = text.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise InvalidArgument(f"{where}: bad port {text!r}") from None
        if not (0 < a <= b <= 65535):
            raise InvalidArgument(f"{where}: port {text!r} outside 1-65535 or reversed")
        out.append((a, b))
    if not out:
        raise InvalidArgument(f"{where}: empty port list")
    return tuple(out)


def _network(text: str, where: str) -> str:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if net.version != 4:
        raise InvalidArgument(f"{where}: only IPv4 is supported (sandboxes have no IPv6)")
    return str(net)


# Static DNS answers are operator configuration, trusted like a raw IP rule (a mirror
# on a private network is their point), but never where no service can be: the host's
# loopback, link-local/metadata, "this network", multicast/reserved, or a sandbox.
_NEVER_STATIC = tuple(
    ipaddress.IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", METADATA_CIDR, "100.64.0.0/12", "224.0.0.0/3")
)


def _static_address(raw: Any, where: str) -> str:
    try:
        ip = ipaddress.IPv4Address(raw if isinstance(raw, str) else str(raw))
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if any(ip in net for net in _NEVER_STATIC):
        raise InvalidArgument(
            f"{where}: static address {ip} is loopback, link-local, a sandbox or reserved"
        )
    return str(ip)


def _service_from(name: str, raw: dict[str, Any], where: str) -> Service:
    unknown = set(raw) - {"hosts", "cidrs", "ports", "addresses"}
    if unknown:
        raise InvalidArgument(f"{where}: unknown keys {sorted(unknown)}")
    hosts = tuple(str(h).lower().rstrip(".") for h in raw.get("hosts", []))
    for h in hosts:
        if not _HOST_RE.match(h):
            raise InvalidArgument(f"{where}: bad host name {h!r}")
    addresses = {
        str(h).lower().rstrip("."): tuple(
            _static_address(a, where) for a in (ips if isinstance(ips, list) else [ips])
        )
        for h, ips in dict(raw.get("addresses", {})).items()
    }
    return Service(
        name=name,
        hosts=hosts,
        cidrs=tuple(_network(str(c), where) for c in raw.get("cidrs", [])),
        ports=_ports(raw["ports"], where) if "ports" in raw else WEB_PORTS,
        addresses=addresses,
    )


def load_catalog(path: str | Path | None = None) -> dict[str, Service]:
    """The shipped services, overridden entry by entry by the file at ``path`` (or
    ``$DSEC_NETWORK_CATALOG``)."""
    services = dict(DEFAULT_SERVICES)
    path = path or os.environ.get("DSEC_NETWORK_CATALOG")
    if not path:
        return services
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"network catalog {p}: {exc}") from None
    for name, raw in dict(data.get("services", {})).items():
        if name in (HOST,):
            raise InvalidArgument(f"network catalog {p}: {name!r} is built in")
        services[name] = _service_from(name, dict(raw), f"network catalog {p}, {name}")
    return services


@dataclass
class Policy:
    """What one sandbox may reach, compiled from its rules."""

    rules: dict[str, bool]
    host: bool = False
    # Static (address . port range) elements: CIDRs of services and raw IP rules.
    static: list[tuple[str, PortRange]] = field(default_factory=list)
    # Allowed DNS names: exact and "*." suffixes, each with the ports it opens.
    names: dict[str, tuple[PortRange, ...]] = field(default_factory=dict)
    suffixes: dict[str, tuple[PortRange, ...]] = field(default_factory=dict)
    static_answers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def lookup(self, qname: str) -> tuple[PortRange, ...] | None:
        """The ports a DNS name opens, or None when the name is not allowed."""
        found = self.match(qname)
        return None if found is None else found[0]

    def match(self, qname: str) -> tuple[tuple[PortRange, ...], str | None] | None:
        """(ports, wildcard zone) of an allowed name: the zone is the ``*.`` suffix it
        matched, None for an exact name; None when the name is not allowed."""
        name = qname.lower().rstrip(".")
        if name in self.names:
            return self.names[name], None
        parts = name.split(".")
        for i in range(1, len(parts)):
            zone = ".".join(parts[i:])
            ports = self.suffixes.get(zone)
            if ports is not None:
                return ports, zone
        return None

    @functools.cached_property
    def exempt(self) -> list[ipaddress.IPv4Network]:
        """The networks a rule of this sandbox allows by address (raw IP rules, service
        CIDRs such as "metadata"): DNS answers inside them are not rebinding."""
        return sorted({ipaddress.IPv4Network(net) for net, _ in self.static})


def compile_rules(rules: dict[str, bool], catalog: dict[str, Service]) -> Policy:
    """Validate ``rules`` against ``catalog`` (InvalidArgument, a 422, on a bad key)."""
    policy = Policy(rules=dict(rules))
    for key, allow in rules.items():
        if not isinstance(allow, bool):
            raise InvalidArgument(f"network rule {key!r}: value must be true or false")
        m = _IP_RULE_RE.match(key) if key[:1].isdigit() else None
        if m is None and key not in catalog:
            raise InvalidArgument(
                f"unknown network rule {key!r}: use a service name ({', '.join(sorted(catalog))})"
                " or an IPv4 rule such as '10.1.2.3', '10.0.0.0/8' or '10.1.2.3:443,8000-8100'"
            )
        if m is not None:
            net = _network(m["net"], f"network rule {key!r}")
            ports = _ports(m["ports"], f"network rule {key!r}") if m["ports"] else ALL_PORTS
            if allow:
                policy.static.extend((net, p) for p in ports)
            continue
        if not allow:
            continue
        svc = catalog[key]
        if key == HOST:
            policy.host = True
        policy.static.extend((c, p) for c in svc.cidrs for p in svc.ports)
        for h in svc.hosts:
            target = policy.suffixes if h.startswith("*.") else policy.names
            name = h[2:] if h.startswith("*.") else h
            target[name] = tuple(sorted(set(target.get(name, ())) | set(svc.ports)))
        for h, ips in svc.addresses.items():
            policy.static_answers[h] = ips
    return policy
