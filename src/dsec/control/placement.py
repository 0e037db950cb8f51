"""Placement: which edge should run a sandbox (docs/CLUSTER.md, "Placement").

Two phases. **Filter** keeps edges that are up, support the backend, carry the labels the
demand selects and have room by the view; **rank** scores them by load and picks one.
The view is the watcher's (refreshed every period, so stale in between) plus this
apiserver's own in-flight reservations; the edge has the last word (AdmissionRejected),
after which the caller tries the next candidate.

Why power-of-k-choices rather than least-loaded: every apiserver reading the same stale
view picks the same "emptiest" edge until the next refresh (the thundering herd), and the
edge refuses what the view promised. Sampling k edges and taking the least loaded of
them is nearly as balanced and spreads concurrent deciders apart (bench/bench_placement.py
measures both).

Several apiservers share one stale view but each knows only its own in-flight creates,
so each would fill the same under-loaded edges and together overshoot them. Each Placer
therefore estimates ``peer_factor`` (everyone's creates / its own, from how much the
reports grew versus how many of its own creates they absorbed) and scores its own
reservations that many times over; the filter still counts only real ones, so this never
causes a false ClusterFull.

What closes the balance gap, measured (bench/bench_placement.py, 160 edges, two
apiservers, imbalance as a ratio to an omniscient least-loaded scan; kept only what
helped, numbers of the full run in the issue's table):

- **Departures this apiserver sees** (``released``): in RL most sandboxes are stopped by
  the trainer through the API, so the apiserver that forwards a stop knows the slot is
  free a view period before the report says so. It is a negative reservation with the
  same stamping rules (counted until a report taken after it). Alone it took the steady
  stream (k=3, stops through a random apiserver) from 5.1x to 4.0x; what made it pay:
- **Own freed slots as candidates** ("join the idle queue"): the last edges where our
  stops freed a slot join the next decision's sample (two per decision; two beat one
  and three or more, one always winning was worse). Steady k=3: ~2.1x; with a single
  apiserver, which then knows every departure, 1.26x (k=5: 1.17x). Only our *own*
  stops: freeing seen in reports (TTL, crash) as candidates made it worse (5.4x vs
  5.0x), every apiserver chasing the same holes.
- **The runner-up survives a view refresh** (remapped to the new edge object instead
  of dropped): burst ratios 1.43x -> 1.30x (one apiserver), 1.82x -> 1.68x (two).
- **A share guard instead of blindness against the herd**: k=3 avoided the herd by
  rarely sampling the holes; k>=4 found them and two apiservers refilled each one twice
  (refill refusals 0.1-0.9%). Now an edge where this apiserver alone used more than
  1/(peer_factor+1) of the room the last report showed is scored +1 (still a candidate:
  never a filter). Zero refill refusals up to k=8, so k=5 is affordable: bursts 1.08x /
  1.36x (k=3: 1.29x / 1.78x) at 44,000 decisions/s per core.
- Tried and dropped: a floor of peer_factor 2 in steady state (worse: the others' creates
  refill *their* holes, not ours), sampling from the emptiest quarter/half of the view
  (little gain, herd refusals back), k=8..64 (steady 2.2x -> 1.7x, costs 2-10x the
  decision time and herds without the guard).

What closed the rest was information, not sampling: with two apiservers each saw only
its own stops and creates until the next report (power-of-5 at 1.95x with 1 s reports,
1.78x as deployed: 0.5 s beats, 0.25 s re-reads; an exhaustive scan of the same view
1.6x). **Piggybacked usage** (``EdgeLoad``): an edge's create and stop answers state its
usage right after, with its usage version ``seq`` (bumped by every admission and release,
carried by heartbeats too), and the apiserver applies it at once when it is newer than
what it holds, so it learns the other apiservers' creates and stops on every edge it
touches (JSQ(d) with piggybacked load). Sequences order answers and reports (an answer
overtaken by a newer one, or a report older than an answer, changes nothing); an own
create confirmed at seq S counts until usage of seq >= S is in force, then never again;
an unanswered one stays counted (at worst twice while in flight, never forgotten). The
edge whose answer was read last joins the next sample: its figures are exact. With it,
k=8 pays (1.39x steady as deployed, 1.35x with 1 s reports, bursts 1.00x / 1.28x) at
~17,000-24,000 decisions/s per core; k=5 reaches 1.43x steady but 1.55x in a two-apiserver
burst. Departures no apiserver sees (TTL, crashes) are still only as fresh as the report
(2.9x as deployed, the scan 3.0x).

Nothing here does I/O: a decision is pure Python over per-update precomputed arrays, so
the cost is k samples, not a scan of every edge (a scan happens only when sampling keeps
landing on full edges, i.e. when the cluster is nearly full).

Edge figures (``cpu_cores``, ``memory_mb``, ``capacity``) are the edge's *admission
budgets* (after any overcommit), the same numbers its own admission checks against.
``cpu_cores == 0`` or ``memory_mb == 0`` means "not reported": that dimension is neither
filtered nor scored. ``capacity == 0`` means the edge takes nothing (draining).

Image layers are not a filter: any edge pulls missing layers from the shared store on
demand; caching them is a locality *preference* (a bonus in the score), bounded so that a
popular image does not pile onto the few edges that happen to have it.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from dsec.api.spec import DSecRunArgs
from dsec.errors import ClusterFull, InvalidArgument

Strategy = Literal["power_of_k", "least_loaded", "random"]
STRATEGIES: tuple[Strategy, ...] = ("power_of_k", "least_loaded", "random")

#: Label prefix on a sandbox spec that selects edges: ``edge.zone=a`` needs edge label zone=a.
SELECTOR_PREFIX = "edge."

_EPS = 1e-9
_REASONS = ("down", "backend", "selector", "image", "refused", "sandboxes", "cpu", "memory")
_CACHE_MAX = 4096
_PEER_MIN_SAMPLE = 16  # own creates per period below which peer_factor is not estimated
_PEER_MAX = 8.0
_HOLES_MAX = 256  # slots freed by our own stops, remembered as candidates
_HOLES_PER_DECISION = 2
_OVER_SHARE_PENALTY = 1.0  # score added to an edge we alone filled past our share
# A piggybacked usage newer (by sequence) than the heartbeat view is trusted this long;
# past it the report wins whatever the sequences say (an edge whose clock stepped back
# across a restart must not pin a stale figure).
_SNAP_TRUST_S = 2.0

#: Response header of an edge's create and stop answers: its usage right after.
LOAD_HEADER = "X-DSec-Edge-Load"


# A sane edge's figures fit these; a value past them is garbage, read as no header.
MAX_LOAD_HEADER = 200
MAX_LOAD_SEQ = 1 << 63


@dataclass(frozen=True)
class EdgeLoad:
    """An edge's usage at one point of its history, piggybacked on its answers.

    Each apiserver sees only its own creates and stops, and the others' only through the
    next heartbeat report; an edge that states its usage on every create and stop answer
    tells each apiserver about the others' placements on every edge it touches (JSQ(d)
    with piggybacked load). ``seq`` is the edge's usage version (bumped on every
    admission and release, and carried by heartbeat reports too): it orders answers and
    reports, and an own create confirmed at ``seq`` is included in any usage with a
    sequence >= it, so it is never counted twice nor forgotten.
    """

    seq: int
    sandboxes: int
    memory_committed_mb: int
    cpu_committed: float

    def header(self) -> str:
        return (
            f"seq={self.seq};n={self.sandboxes};mem={self.memory_committed_mb};"
            f"cpu={self.cpu_committed:.3f}"
        )

    @classmethod
    def parse(cls, value: str | None) -> EdgeLoad | None:
        """The header's value; None if absent or malformed (an older edge: reports only)."""
        if not value or len(value) > MAX_LOAD_HEADER:
            return None
        try:
            f = dict(part.split("=", 1) for part in value.split(";"))
            load = cls(int(f["seq"]), int(f["n"]), int(f["mem"]), float(f["cpu"]))
        except (KeyError, ValueError):
            return None
        if not 0 < load.seq < MAX_LOAD_SEQ:
            return None
        if not (
            0 <= load.sandboxes < MAX_LOAD_SEQ and 0 <= load.memory_committed_mb < MAX_LOAD_SEQ
        ):
            return None
        if not 0 <= load.cpu_committed < 1e9:  # also NaN and inf
            return None
        return load


@dataclass
class EdgeView:
    """One edge as the watcher last saw it; ``seen_at`` is when its figures were taken.

    ``seen_at`` must be on the Placer's clock (epoch seconds by default): a view newer
    than a reservation or a refusal supersedes it.
    """

    edge_id: str
    url: str
    up: bool = True
    capacity: int = 0
    sandboxes: int = 0
    cpu_cores: float = 0.0
    cpu_committed: float = 0.0
    memory_mb: int = 0
    memory_committed_mb: int = 0
    backends: frozenset[str] = frozenset({"container"})
    labels: dict[str, str] = field(default_factory=dict)
    layers: frozenset[str] = frozenset()
    seen_at: float = 0.0
    # Loads any layer on demand from a shared layer store: ``Demand.requires`` is no
    # filter for it. Without a shared store, an edge runs only what it holds.
    lazy: bool = False
    # The edge's usage version of these figures (EdgeLoad.seq); 0: unknown, so only
    # times order this view against reservations.
    seq: int = 0


@dataclass(frozen=True)
class Demand:
    """What one sandbox needs from an edge."""

    backend: str = "container"
    cpu_cores: float = 1.0
    memory_mb: int = 512
    layers: frozenset[str] = frozenset()
    selector: dict[str, str] = field(default_factory=dict, hash=False)
    # What an edge must hold unless it is ``lazy`` (the image, in the cluster router):
    # a filter, where ``layers`` is only a preference.
    requires: frozenset[str] = frozenset()

    @classmethod
    def for_spec(
        cls,
        spec: DSecRunArgs,
        backend: str,
        layers: frozenset[str] = frozenset(),
        requires: frozenset[str] = frozenset(),
    ) -> Demand:
        """Demand of a spec; spec labels ``edge.<key>=<value>`` become the edge selector.

        Only the ``edge.`` labels select edges (the rest are the sandbox's own tags), so a
        user pins a sandbox to a zone with ``labels={"edge.zone": "a"}``.
        """
        selector: dict[str, str] = {}
        for key, value in spec.labels.items():
            if key.startswith(SELECTOR_PREFIX):
                name = key[len(SELECTOR_PREFIX) :]
                if not name:
                    raise InvalidArgument(
                        f"label {key!r} selects no edge label: use 'edge.<name>=<value>'",
                        label=key,
                    )
                selector[name] = value
        return cls(
            backend=backend,
            cpu_cores=spec.cpu_cores_limit,
            memory_mb=spec.memory_limit_mb,
            layers=layers,
            selector=selector,
            requires=requires,
        )


class _Res:
    """One in-flight create of this apiserver, counted until a newer view includes it.

    ``seq``: the edge's usage version right after it admitted (or released) this one,
    when its answer said; ``done``: the edge answered (confirmed, or a release).
    """

    __slots__ = ("cpu", "done", "mem", "seq", "stamp")

    def __init__(self, stamp: float, cpu: float, mem: int, done: bool = False) -> None:
        self.stamp = stamp
        self.cpu = cpu
        self.mem = mem
        self.seq: int | None = None
        self.done = done


def _included(r: _Res, seq: int, seen_at: float) -> bool:
    """Whether usage figures of version ``seq`` taken at ``seen_at`` already count ``r``.

    Sequences decide when both sides have one. An unanswered create against a sequenced
    view is kept (it may not be admitted yet: at worst counted twice while in flight,
    never forgotten); otherwise, as without sequences, figures taken after the stamp
    include it.
    """
    if seq:
        if r.seq is not None:
            return r.seq <= seq
        if not r.done:
            return False
    return r.stamp <= seen_at


def _with_load(v: EdgeView, load: EdgeLoad) -> EdgeView:
    """``v`` with the usage of a newer answer (the rest, capacity included, as reported).

    A shallow copy by ``__dict__`` (no field validation to run): on every create
    answer, where ``dataclasses.replace`` was most of the cost of ``observe``.
    """
    out = object.__new__(EdgeView)
    out.__dict__.update(v.__dict__)
    out.sandboxes = load.sandboxes
    out.cpu_committed = load.cpu_committed
    out.memory_committed_mb = load.memory_committed_mb
    out.seq = load.seq
    return out


class _Edge:
    """An edge's view plus reservations, flattened into slots for the hot loop."""

    __slots__ = (
        "base",
        "cap",
        "cpu_total",
        "ghost_cpu",
        "ghost_mem",
        "ghost_n",
        "inv_cap",
        "inv_cpu",
        "inv_mem",
        "layers",
        "mem_total",
        "refused",
        "used_cpu",
        "used_mem",
        "used_n",
        "view",
    )

    def __init__(self, view: EdgeView, res: list[_Res], rel: list[_Res], refused: bool) -> None:
        self.refused = refused
        self.set(view, res, rel)

    def set(self, view: EdgeView, res: list[_Res], rel: list[_Res]) -> None:
        """(Re)compute from figures and what they do not include yet; in place, so the
        filter caches that hold this object stay valid."""
        self.view = view
        self.cap = view.capacity
        self.cpu_total = view.cpu_cores
        self.mem_total = view.memory_mb
        self.inv_cap = 1.0 / view.capacity if view.capacity > 0 else 1.0
        self.inv_cpu = 1.0 / view.cpu_cores if view.cpu_cores > 0 else 0.0
        self.inv_mem = 1.0 / view.memory_mb if view.memory_mb > 0 else 0.0
        self.layers = view.layers
        # a report is never below zero, so neither is a report minus what we saw leave
        self.used_n = max(0, view.sandboxes + len(res) - len(rel))
        self.used_cpu = max(
            0.0, view.cpu_committed + sum(r.cpu for r in res) - sum(r.cpu for r in rel)
        )
        self.used_mem = max(
            0, view.memory_committed_mb + sum(r.mem for r in res) - sum(r.mem for r in rel)
        )
        # score-only estimate of what other apiservers placed here since the view
        self.ghost_n = 0.0
        self.ghost_cpu = 0.0
        self.ghost_mem = 0.0
        self.base = self._real_load(view.sandboxes, view.cpu_committed, view.memory_committed_mb)

    def _real_load(self, n: float, cpu: float, mem: float) -> float:
        a = n * self.inv_cap
        b = cpu * self.inv_cpu
        c = mem * self.inv_mem
        return a if a >= b and a >= c else (b if b >= c else c)

    def over_share(self, div: float) -> bool:
        """This apiserver alone took more than 1/div of the room the view showed."""
        added = self._real_load(self.used_n, self.used_cpu, self.used_mem) - self.base
        return added > (1.0 - self.base) / div

    def load(self) -> float:
        """max(sandbox, cpu, memory fraction): the scarcest resource decides."""
        a = (self.used_n + self.ghost_n) * self.inv_cap
        b = (self.used_cpu + self.ghost_cpu) * self.inv_cpu
        c = (self.used_mem + self.ghost_mem) * self.inv_mem
        return a if a >= b and a >= c else (b if b >= c else c)

    def room(self, cpu: float, mem: int) -> bool:
        if self.refused or self.used_n >= self.cap:
            return False
        if self.cpu_total > 0 and self.used_cpu + cpu > self.cpu_total + _EPS:
            return False
        return not (self.mem_total > 0 and self.used_mem + mem > self.mem_total)

    def why_not(self, d: Demand) -> str | None:
        """The first filter this edge fails for ``d`` (None: it could take it)."""
        v = self.view
        if not v.up:
            return "down"
        if d.backend not in v.backends:
            return "backend"
        if any(v.labels.get(k) != val for k, val in d.selector.items()):
            return "selector"
        if not (v.lazy or d.requires <= v.layers):
            return "image"
        if self.refused:
            return "refused"
        if self.used_n >= self.cap:
            return "sandboxes"
        if self.cpu_total > 0 and self.used_cpu + d.cpu_cores > self.cpu_total + _EPS:
            return "cpu"
        if self.mem_total > 0 and self.used_mem + d.memory_mb > self.mem_total:
            return "memory"
        return None


class Placer:
    """Ranks edges for a create; one per apiserver, fed by the watcher's view.

    ``locality_weight`` is the score bonus (in load fraction) of an edge that caches all
    of a demand's layers: with 0.1, a cached edge wins unless it is more than 10
    percentage points fuller than the best uncached choice, which bounds how far a
    popular image can pile up on the edges that cache it.
    """

    def __init__(
        self,
        strategy: Strategy = "power_of_k",
        k: int = 2,
        rng: random.Random | None = None,
        locality_weight: float = 0.1,
        *,
        clock: Callable[[], float] = time.time,
        reservation_ttl: float = 60.0,
    ) -> None:
        if strategy not in STRATEGIES:
            raise InvalidArgument(
                f"unknown placement strategy {strategy!r}; use one of {', '.join(STRATEGIES)}",
                strategy=strategy,
            )
        if k < 1:
            raise InvalidArgument(f"k must be >= 1, got {k}", k=k)
        if locality_weight < 0:
            raise InvalidArgument("locality_weight must be >= 0", locality_weight=locality_weight)
        self.strategy: Strategy = strategy
        self.k = k
        self.rng = rng if rng is not None else random.Random()
        self.locality_weight = locality_weight
        self.clock = clock
        self.reservation_ttl = reservation_ttl
        self._edges: dict[str, _Edge] = {}
        self._order: list[_Edge] = []
        self._res: dict[str, list[_Res]] = {}
        self._rel: dict[str, list[_Res]] = {}
        self._holes: deque[str] = deque(maxlen=_HOLES_MAX)
        self._refused_at: dict[str, float] = {}
        self.refusals: dict[str, dict[str, Any]] = {}
        self._eligible: dict[
            tuple[str, tuple[tuple[str, str], ...], frozenset[str]], list[_Edge]
        ] = {}
        self._local: dict[tuple[Any, ...], list[_Edge]] = {}
        self._memo: tuple[Any, _Edge] | None = None
        self._prev_n: dict[str, int] = {}
        self._snap: dict[str, tuple[EdgeLoad, float]] = {}  # newest answer's usage, when
        self._acc_landed = 0
        self._acc_growth = 0
        self._acc_since = self.clock()
        #: estimated (all apiservers' creates) / (this one's) over the last view period
        self.peer_factor = 1.0
        self._fresh: str | None = None  # the edge whose answer we read last

    # -- the view --------------------------------------------------------------------

    def update(self, views: Iterable[EdgeView]) -> None:
        """Replace the watcher's view; drop what a newer report now accounts for.

        A reservation is dropped once its edge reports figures that include it (by
        sequence, or taken at or after the reservation's stamp: no double count) and
        kept while they do not (not forgotten). Reservations older than
        ``reservation_ttl`` are dropped anyway so a lost unreserve cannot leak load.
        Usage an edge stated in an answer since (``observe``) and newer than its report
        stays in force.
        """
        now = self.clock()
        edges: dict[str, _Edge] = {}
        order: list[_Edge] = []
        prev_n = self._prev_n
        landed = 0  # own creates this report newly includes
        growth = 0  # sandboxes the reports gained, everyone's creates minus departures
        snaps = self._snap
        for v in views:
            snap = snaps.get(v.edge_id)
            if snap is not None:
                load, at = snap
                if load.seq > v.seq and (v.seq or at >= v.seen_at) and now - at < _SNAP_TRUST_S:
                    v = _with_load(v, load)
                else:
                    del snaps[v.edge_id]
            before = prev_n.get(v.edge_id)
            if before is not None:
                growth += v.sandboxes - before
            res, got = self._prune(self._res, v, now)
            landed += got
            rel, _ = self._prune(self._rel, v, now)
            refused_at = self._refused_at.get(v.edge_id)
            refused = refused_at is not None and refused_at > v.seen_at
            if refused_at is not None and not refused:
                del self._refused_at[v.edge_id]
                self.refusals.pop(v.edge_id, None)
            e = _Edge(v, res, rel, refused)
            edges[v.edge_id] = e
            order.append(e)
        self._edges = edges
        self._order = order
        self._prev_n = {e.view.edge_id: e.view.sandboxes for e in order}
        self._acc_landed += landed
        self._acc_growth += growth
        self._estimate_peers(now)
        self._eligible = {}
        self._local = {}
        # the runner-up outlives the refresh (on the new figures): dropping it at every
        # view cost balance, the more so the fresher the view
        memo = self._memo
        again = edges.get(memo[1].view.edge_id) if memo is not None else None
        self._memo = (memo[0], again) if memo is not None and again is not None else None

    def _prune(
        self, store: dict[str, list[_Res]], v: EdgeView, now: float
    ) -> tuple[list[_Res], int]:
        """What ``v`` does not include yet (and is younger than the TTL); and how many
        it newly includes."""
        items = store.get(v.edge_id)
        if not items:
            return [], 0
        seq, seen_at, ttl = v.seq, v.seen_at, self.reservation_ttl
        keep = [r for r in items if not _included(r, seq, seen_at)]
        got = len(items) - len(keep)
        keep = [r for r in keep if now - r.stamp < ttl]
        if keep:
            store[v.edge_id] = keep
        else:
            del store[v.edge_id]
        return keep, got

    def observe(self, edge_id: str, load: EdgeLoad) -> None:
        """Usage ``edge_id`` stated in an answer (``EdgeLoad``, its create and stop
        answers carry it): in force at once if newer than what this apiserver holds,
        including every other apiserver's creates and stops there; own creates and
        stops it includes stop counting. An older one (answers crossing) changes
        nothing but what it includes.
        """
        now = self.clock()
        snap = self._snap.get(edge_id)
        if snap is None or load.seq > snap[0].seq:
            self._snap[edge_id] = (load, now)
        e = self._edges.get(edge_id)
        if e is None:
            return
        v = e.view
        newer = load.seq > v.seq
        if newer:
            before = self._prev_n.get(edge_id)
            if before is not None:
                self._acc_growth += load.sandboxes - before
            self._prev_n[edge_id] = load.sandboxes
            v = _with_load(v, load)
        res, got = self._prune(self._res, v, now)
        rel, gone = self._prune(self._rel, v, now)
        self._acc_landed += got
        if newer or got or gone:
            e.set(v, res, rel)

    def _estimate_peers(self, now: float) -> None:
        """peer_factor = everyone's net creates / ours, over enough of ours to mean something.

        Accumulates across updates (a refresh may bring no new report); departures make
        it an underestimate, hence the floor of 1 (we alone). An estimate that cannot
        complete within ``reservation_ttl`` (we hardly place) falls back to 1.
        """
        if self._acc_landed >= _PEER_MIN_SAMPLE:
            ratio = self._acc_growth / self._acc_landed
            self.peer_factor = min(_PEER_MAX, max(1.0, ratio))
        elif now - self._acc_since < self.reservation_ttl:
            return
        else:
            self.peer_factor = 1.0
        self._acc_landed = 0
        self._acc_growth = 0
        self._acc_since = now

    def views(self) -> list[EdgeView]:
        return [e.view for e in self._order]

    def load(self, edge_id: str) -> float:
        """Load score of an edge including this apiserver's reservations."""
        return self._edges[edge_id].load()

    # -- in-flight view --------------------------------------------------------------

    def reserve(self, edge_id: str, demand: Demand) -> None:
        """Count a create this apiserver is about to send to ``edge_id``.

        When other apiservers were placing too during the last view period
        (``peer_factor`` > 1), the score also counts ``peer_factor - 1`` of their
        creates here: they read the same stale view and favour the same edges, so
        without it every apiserver fills the same holes and together overshoot them.
        The filter (room) counts only real reservations.
        """
        r = _Res(self.clock(), demand.cpu_cores, demand.memory_mb)
        self._res.setdefault(edge_id, []).append(r)
        e = self._edges.get(edge_id)
        if e is not None:
            e.used_n += 1
            e.used_cpu += r.cpu
            e.used_mem += r.mem
            extra = self.peer_factor - 1.0
            if extra > 0:
                e.ghost_n += extra
                e.ghost_cpu += extra * r.cpu
                e.ghost_mem += extra * r.mem

    def confirm(self, edge_id: str, demand: Demand, load: EdgeLoad | None = None) -> None:
        """The edge accepted, stating its usage right after (``load``) or not.

        With ``load`` the create is counted in the edge's usage from then on (and every
        other apiserver's creates there with it). Without, restamp so that only a report
        taken after now supersedes it: a report taken between reserve and the edge's
        admission would otherwise drop the reservation one period early.
        """
        r = self._find(edge_id, demand)
        if r is not None:
            r.stamp = self.clock()
            r.done = True
            if load is not None:
                r.seq = load.seq
        if load is not None:
            self.observe(edge_id, load)
            self._fresh = edge_id

    def unreserve(self, edge_id: str, demand: Demand) -> None:
        """The create failed or was refused: stop counting it (no-op if already superseded)."""
        res = self._res.get(edge_id)
        r = self._find(edge_id, demand)
        if r is None or res is None:
            return
        res.remove(r)
        if not res:
            del self._res[edge_id]
        e = self._edges.get(edge_id)
        if e is not None:
            e.used_n -= 1
            e.used_cpu -= r.cpu
            e.used_mem -= r.mem

    def released(self, edge_id: str, demand: Demand, load: EdgeLoad | None = None) -> None:
        """A sandbox of ``demand`` left ``edge_id`` through this apiserver (a stop it sent).

        A negative reservation: counted (score and room) until the edge's figures
        include the departure (``load``, the stop answer's usage, does at once; else a
        report taken at or after now); ``reservation_ttl`` bounds it like a
        reservation. Call it once the edge has acknowledged the stop, so that any
        report stamped later really lacks the sandbox. It also lifts a refusal older
        than now: the edge has a free slot again.
        """
        now = self.clock()
        r = _Res(now, demand.cpu_cores, demand.memory_mb, done=True)
        if load is not None:
            r.seq = load.seq
        self._rel.setdefault(edge_id, []).append(r)
        refused_at = self._refused_at.get(edge_id)
        if refused_at is not None and refused_at <= now:
            del self._refused_at[edge_id]
            self.refusals.pop(edge_id, None)
        self._holes.append(edge_id)
        e = self._edges.get(edge_id)
        if e is not None:
            e.used_n = max(0, e.used_n - 1)
            e.used_cpu = max(0.0, e.used_cpu - r.cpu)
            e.used_mem = max(0, e.used_mem - r.mem)
            e.refused = e.refused and edge_id in self._refused_at
        if load is not None:
            self.observe(edge_id, load)

    def _find(self, edge_id: str, demand: Demand) -> _Res | None:
        """The newest matching reservation, one still unanswered if there is one."""
        found = None
        for r in reversed(self._res.get(edge_id, ())):
            if r.cpu == demand.cpu_cores and r.mem == demand.memory_mb:
                if not r.done:
                    return r
                found = found or r
        return found

    def refused(self, edge_id: str, figures: dict[str, Any]) -> None:
        """The edge answered AdmissionRejected: treat it as full until its next report."""
        self._refused_at[edge_id] = self.clock()
        self.refusals[edge_id] = dict(figures)
        e = self._edges.get(edge_id)
        if e is not None:
            e.refused = True

    def reserved(self, edge_id: str) -> int:
        """How many in-flight creates this apiserver counts on ``edge_id``."""
        return len(self._res.get(edge_id, ()))

    # -- decisions -------------------------------------------------------------------

    def candidates(self, demand: Demand, n: int = 3) -> list[EdgeView]:
        """Up to ``n`` distinct edges to try, best first; ClusterFull if none has room."""
        if n < 1:
            raise InvalidArgument(f"n must be >= 1, got {n}", n=n)
        key = (demand.backend, tuple(sorted(demand.selector.items())), demand.requires)
        pool = self._eligible.get(key)
        if pool is None:
            pool = self._filter_static(demand)
            if len(self._eligible) >= _CACHE_MAX:
                self._eligible.clear()
            self._eligible[key] = pool
        chosen: list[_Edge]
        if self.strategy == "least_loaded":
            chosen = self._least_loaded(pool, demand, n)
        elif self.strategy == "random":
            chosen = self._sampled(pool, None, demand, n, 1)
        else:
            local = self._local_pool(key, pool, demand) if demand.layers else None
            chosen = self._sampled(pool, local, demand, n, self.k, key)
        if not chosen:
            raise self._full(demand)
        return [e.view for e in chosen]

    def _filter_static(self, d: Demand) -> list[_Edge]:
        """Up, right backend, selector matches, holds what is required (or loads it
        lazily): fixed between updates, so cached."""
        sel = d.selector.items()
        need = d.requires
        return [
            e
            for e in self._order
            if e.view.up
            and d.backend in e.view.backends
            and all(e.view.labels.get(k) == v for k, v in sel)
            and (e.view.lazy or need <= e.view.layers)
        ]

    def _local_pool(self, key: Any, pool: list[_Edge], d: Demand) -> list[_Edge]:
        lkey = (key, d.layers)
        local = self._local.get(lkey)
        if local is None:
            layers = d.layers
            local = [e for e in pool if layers <= e.layers]
            if len(self._local) >= _CACHE_MAX:
                self._local.clear()
            self._local[lkey] = local
        return local

    def _bonus(self, e: _Edge, d: Demand) -> float:
        if not d.layers or self.locality_weight == 0:
            return 0.0
        if d.layers <= e.layers:
            return self.locality_weight
        return self.locality_weight * len(d.layers & e.layers) / len(d.layers)

    def _least_loaded(self, pool: list[_Edge], d: Demand, n: int) -> list[_Edge]:
        cpu, mem = d.cpu_cores, d.memory_mb
        loc = bool(d.layers) and self.locality_weight > 0
        scored = [
            (e.load() - (self._bonus(e, d) if loc else 0.0), i, e)
            for i, e in enumerate(pool)
            if e.room(cpu, mem)
        ]
        return [t[2] for t in heapq.nsmallest(n, scored)]

    def _sample_room(
        self, pool: list[_Edge], want: int, d: Demand, exclude: list[_Edge], scan: bool
    ) -> list[_Edge]:
        """Up to ``want`` distinct edges with room, uniformly from ``pool``.

        Rejection sampling (cheap while most edges have room); when it keeps missing and
        ``scan`` is set, fall back to one pass that lists every edge with room.
        """
        m = len(pool)
        if m == 0:
            return []
        cpu, mem = d.cpu_cores, d.memory_mb
        rnd = self.rng.random
        got: list[_Edge] = []
        tries = 4 * want + 8
        while len(got) < want and tries > 0:
            tries -= 1
            e = pool[int(rnd() * m)]
            if e in got or e in exclude or not e.room(cpu, mem):
                continue
            got.append(e)
        if len(got) < want and scan:
            rest = [e for e in pool if e not in got and e not in exclude and e.room(cpu, mem)]
            need = min(want - len(got), len(rest))
            got.extend(self.rng.sample(rest, need))
        return got

    def _sampled(
        self,
        pool: list[_Edge],
        local: list[_Edge] | None,
        d: Demand,
        n: int,
        k: int,
        key: Any = None,
    ) -> list[_Edge]:
        """n picks, each the best of k sampled edges (plus k from the locality subset).

        With ``key`` (power-of-k), the runner-up of the previous decision for the same
        filter joins the sample ("two choices with memory"): tighter balance for free,
        and no herd since each apiserver remembers its own random samples.
        """
        chosen: list[_Edge] = []
        loc_w = self.locality_weight if d.layers else 0.0
        for i in range(n):
            sample = self._sample_room(pool, k, d, chosen, scan=True)
            if not sample:
                break
            if local and loc_w > 0:
                for e in self._sample_room(local, k, d, chosen + sample, scan=False):
                    sample.append(e)
            if i == 0 and key is not None:
                for _ in range(_HOLES_PER_DECISION):
                    hole = self._hole(d, sample)
                    if hole is None:
                        break
                    sample.append(hole)
                # the edge our last create's answer described: its figures are exact,
                # others' creates included, so it is a safe candidate (no herd)
                fresh = self._edges.get(self._fresh) if self._fresh is not None else None
                if fresh is not None and fresh not in sample and fresh.why_not(d) is None:
                    sample.append(fresh)
            memo = self._memo
            if (
                i == 0
                and key is not None
                and memo is not None
                and memo[0] == key
                and memo[1] not in sample
                and memo[1].why_not(d) is None
            ):
                sample.append(memo[1])
            if len(sample) == 1:
                chosen.append(sample[0])
                continue
            div = self.peer_factor + 1.0
            scored = sorted(
                (
                    e.load()
                    - (self._bonus(e, d) if loc_w else 0.0)
                    + (_OVER_SHARE_PENALTY if e.over_share(div) else 0.0),
                    j,
                    e,
                )
                for j, e in enumerate(sample)
            )
            chosen.append(scored[0][2])
            if i == 0 and key is not None:
                self._memo = (key, scored[1][2])
        return chosen

    def _hole(self, d: Demand, sample: list[_Edge]) -> _Edge | None:
        holes = self._holes
        while holes:
            e = self._edges.get(holes.popleft())
            if e is None or e in sample or e.why_not(d) is not None:
                continue
            return e
        return None

    def _full(self, d: Demand) -> ClusterFull:
        reasons = dict.fromkeys(_REASONS, 0)
        up = [e for e in self._order if e.view.up]
        for e in self._order:
            why = e.why_not(d)
            if why is not None:
                reasons[why] += 1
        details: dict[str, Any] = {
            "edges": len(self._order),
            "edges_up": len(up),
            "capacity": sum(e.cap for e in up),
            "sandboxes": sum(e.used_n for e in up),
            "cpu_free": round(sum(max(0.0, e.cpu_total - e.used_cpu) for e in up), 3),
            "memory_free_mb": sum(max(0, e.mem_total - e.used_mem) for e in up),
            "reasons": {k: v for k, v in reasons.items() if v},
            "demand": {
                "backend": d.backend,
                "cpu_cores": d.cpu_cores,
                "memory_mb": d.memory_mb,
                "selector": dict(d.selector),
            },
        }
        why = ", ".join(f"{k}: {v}" for k, v in details["reasons"].items()) or "no edges"
        return ClusterFull(
            f"no edge can take a {d.backend} sandbox ({d.cpu_cores:g} cores, "
            f"{d.memory_mb} MiB): {len(up)} of {len(self._order)} edges up, "
            f"{details['sandboxes']}/{details['capacity']} sandboxes; filtered out by {why}",
            **details,
        )
