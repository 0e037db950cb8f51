"""Control-plane placement (issue 8, docs/CLUSTER.md "Placement"): speed and balance.

    .venv/bin/python bench/bench_placement.py [--quick | --smoke] [--out PATH]

Simulated edges in process, each with its own admission (it refuses when full: the edge
has the final say), and a watcher view refreshed only every ``--period-ms`` of simulated
time, so decisions in between run on a stale view plus each apiserver's own in-flight
reservations. Two apiservers with independent reservations share that one stale view
(where least-loaded herds); "least_loaded_omniscient" refreshes the view before every
decision and is the balance baseline.

Scenarios: a job burst (32,000 sandboxes into 160 edges; also with one apiserver, and
with a 0.5 s view), an overflow burst past capacity (ClusterFull), a refill (a tenth of
the edges of a 90%-full cluster half emptied at once: the herd), a steady stream (Poisson
arrivals, exponential lifetimes) and locality (half the demand is one popular image
cached on 5% of the edges; the others cached on random quarters; caches are static: the
worst case). The steady stream comes in two kinds of departures: stops sent through a
random apiserver, which tells its Placer (``released``; the RL trainer stops its
sandboxes through the API), and "unseen" ones that happen on the edges (TTL, crash),
known only from the next report; each with a 1 s and a 0.5 s view, and once with a single
apiserver. "prod" runs the steady stream as deployed: every edge beats every 0.5 s (its
own phase) and each apiserver re-reads the view every 0.25 s.

The simulated edges answer creates and stops as a real edge does: with their usage in
the ``X-DSec-Edge-Load`` header (an EdgeLoad with its sequence), which the simulated
apiserver parses and hands to its Placer (``confirm``/``released``) as
dsec.cluster.router does; "power_of_k5_reports_only" ignores it (the placement before:
reports and own in-flight view only). Every strategy runs the same seeded edges,
demands and arrivals.

Reported per strategy: decisions/s per core (process time spent in the Placer only,
view updates included), p50/p99 decision latency (candidates()), imbalance (population
std dev of the edges' load fraction: end of burst, mean over steady state), rejection
rate (edge refusals / attempts), locality hit rate and hot-spotting (max load among the
popular image's cachers / mean load). Targets: >= 2,000 decisions/s per core; power-of-k
imbalance within 1.5x of the omniscient least-loaded, without its herd rejections. The
stale least-loaded scan's own ratio is in the table too: it has the same information as
power-of-k, so where it misses the target too, the gap is the view, not the sampling.
Writes bench/results/placement.json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from dsec.api.spec import BackendKind  # noqa: E402
from dsec.control.placement import Demand, EdgeLoad, EdgeView, Placer, Strategy  # noqa: E402
from dsec.errors import ClusterFull  # noqa: E402

# name -> (strategy, k, omniscient, piggyback: the apiservers read the usage the edges
# state in their create and stop answers; without it, reports only: the baseline)
STRATEGIES: dict[str, tuple[Strategy, int, bool, bool]] = {
    "random": ("random", 1, False, True),
    "least_loaded": ("least_loaded", 1, False, True),
    "power_of_k2": ("power_of_k", 2, False, True),
    "power_of_k3": ("power_of_k", 3, False, True),
    "power_of_k5": ("power_of_k", 5, False, True),
    "power_of_k8": ("power_of_k", 8, False, True),
    "power_of_k5_reports_only": ("power_of_k", 5, False, False),
    "least_loaded_omniscient": ("least_loaded", 1, True, False),
}
CAPACITIES = (150, 200, 250, 300)
SMALL = Demand(cpu_cores=1.0, memory_mb=1024)
PROD_BEAT = 0.5  # dsec.cluster.node: an edge's heartbeat interval
PROD_REFRESH = 0.25  # dsec.cluster.router: how often an apiserver re-reads the view
LARGE = Demand(cpu_cores=2.0, memory_mb=4096)


@dataclass
class SimEdge:
    """An edge that admits for real: refuses when any budget would be exceeded."""

    edge_id: str
    capacity: int
    cpu: float
    mem: int
    layers: frozenset[str] = frozenset()
    n: int = 0
    cpu_used: float = 0.0
    mem_used: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    seq: int = 1  # usage version, as a real edge's Admission.seq

    def admit(self, d: Demand) -> bool:
        if (
            self.n >= self.capacity
            or self.cpu_used + d.cpu_cores > self.cpu + 1e-9
            or self.mem_used + d.memory_mb > self.mem
        ):
            return False
        self.n += 1
        self.cpu_used += d.cpu_cores
        self.mem_used += d.memory_mb
        self.seq += 1
        return True

    def release(self, d: Demand) -> None:
        self.n -= 1
        self.cpu_used -= d.cpu_cores
        self.mem_used -= d.memory_mb
        self.seq += 1

    def load_header(self) -> str:
        """What a real edge puts in its create and stop answers (``LOAD_HEADER``)."""
        return EdgeLoad(self.seq, self.n, self.mem_used, self.cpu_used).header()

    def load(self) -> float:
        return max(self.n / self.capacity, self.cpu_used / self.cpu, self.mem_used / self.mem)

    def view(self, now: float) -> EdgeView:
        return EdgeView(
            edge_id=self.edge_id,
            url=f"http://{self.edge_id}.sim:8471",
            capacity=self.capacity,
            sandboxes=self.n,
            cpu_cores=self.cpu,
            cpu_committed=self.cpu_used,
            memory_mb=self.mem,
            memory_committed_mb=self.mem_used,
            backends=frozenset({BackendKind.CONTAINER.value}),
            labels=self.labels,
            layers=self.layers,
            seen_at=now,
            seq=self.seq,
        )


def make_edges(count: int, rng: random.Random, images: dict[str, frozenset[str]]) -> list[SimEdge]:
    """Heterogeneous edges; budgets sized so sandboxes bind first, CPU close behind."""
    edges = []
    for i in range(count):
        cap = CAPACITIES[i % len(CAPACITIES)]
        edges.append(
            SimEdge(
                f"e{i}",
                capacity=cap,
                cpu=cap * 1.3,
                mem=int(cap * 1.9 * 1024),
                labels={"zone": "ab"[i % 2]},
            )
        )
    popular = images.get("pop")
    for j, (name, layers) in enumerate(images.items()):
        if name == "pop" and popular is not None:
            holders = rng.sample(edges, max(1, count // 20))
        else:
            holders = rng.sample(edges, max(1, count // 4))
        del j
        for e in holders:
            e.layers = e.layers | layers
    return edges


class Oracle:
    """Omniscient least-loaded: scans the edges' true state before every decision.

    The balance baseline (no view could be fresher); not a Placer, so it has no
    throughput figure of its own.
    """

    def __init__(self, edges: list[SimEdge], locality_weight: float) -> None:
        self.edges = edges
        self.w = locality_weight

    def candidates(self, d: Demand, n: int) -> list[SimEdge]:
        scored = []
        for i, e in enumerate(self.edges):
            if (
                e.n >= e.capacity
                or e.cpu_used + d.cpu_cores > e.cpu + 1e-9
                or e.mem_used + d.memory_mb > e.mem
            ):
                continue
            bonus = 0.0
            if d.layers and self.w:
                bonus = self.w * len(d.layers & e.layers) / len(d.layers)
            scored.append((e.load() - bonus, i, e))
        return [t[2] for t in heapq.nsmallest(n, scored)]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Sim:
    """Edges + a stale watcher view + ``apiservers`` placers with their own reservations.

    The view is every edge's state at each refresh (``beat`` None), or, as deployed,
    each edge's last heartbeat (every ``beat`` s, phases spread at random) re-read every
    ``period`` s. With piggyback, create and stop answers carry the edge's usage header
    and the placer reads it, as dsec.cluster.router does with a real edge's answers.
    """

    def __init__(
        self,
        edges: list[SimEdge],
        name: str,
        *,
        apiservers: int,
        period: float,
        seed: int,
        locality_weight: float = 0.1,
        beat: float | None = None,
    ) -> None:
        strategy, k, omniscient, piggyback = STRATEGIES[name]
        self.edges = edges
        self.by_id = {e.edge_id: e for e in edges}
        self.now = 0.0
        self.period = 0.0 if omniscient else period
        self.piggyback = piggyback
        self.beat = None if omniscient else beat
        self.last_views = [e.view(0.0) for e in edges]
        phase = random.Random(seed + 11)
        self.beats = [(phase.uniform(0, beat or 1.0), i) for i in range(len(edges))]
        heapq.heapify(self.beats)
        self.placers = [
            Placer(
                strategy,
                k=k,
                rng=random.Random(seed * 100 + i),
                locality_weight=locality_weight,
                clock=self._clock,
            )
            for i in range(apiservers)
        ]
        self.oracle = Oracle(edges, locality_weight) if omniscient else None
        self.next_refresh = 0.0
        self.cpu = 0.0
        self.lat: list[float] = []
        self.decisions = 0
        self.attempts = 0
        self.refusals = 0
        self.cluster_full = 0
        self.placed = 0
        self.failed = 0
        self.local_hits = 0
        self.turn = 0
        self.stop_rng = random.Random(seed + 7)

    def _clock(self) -> float:
        return self.now

    def refresh(self) -> None:
        views = self.last_views if self.beat else [e.view(self.now) for e in self.edges]
        t = time.process_time()
        for p in self.placers:
            p.update(views)
        self.cpu += time.process_time() - t

    def advance(self, now: float) -> None:
        """To ``now``, before the event due then: the state is still what it was at
        every heartbeat since the last event, so those reports are exact."""
        self.now = now
        if self.oracle is not None:
            return
        beat, beats = self.beat, self.beats
        if beat:
            while beats[0][0] <= now:
                t, i = beats[0]
                self.last_views[i] = self.edges[i].view(t)
                heapq.heapreplace(beats, (t + beat, i))
        if now >= self.next_refresh:
            self.refresh()
            self.next_refresh = now + self.period

    def _answer(self, edge: SimEdge) -> EdgeLoad | None:
        """The usage an edge's answer states, parsed as the router parses a real one."""
        return EdgeLoad.parse(edge.load_header()) if self.piggyback else None

    def place(self, d: Demand) -> SimEdge | None:
        """One create as the apiserver's router would do it: candidates, try in order."""
        if self.oracle is not None:
            t0 = time.perf_counter()
            picks = self.oracle.candidates(d, 1)
            self.lat.append(time.perf_counter() - t0)
            self.decisions += 1
            if not picks:
                self.cluster_full += 1
                self.failed += 1
                return None
            self.attempts += 1
            assert picks[0].admit(d)
            self.placed += 1
            if d.layers and d.layers <= picks[0].layers:
                self.local_hits += 1
            return picks[0]
        p = self.placers[self.turn]
        self.turn = (self.turn + 1) % len(self.placers)
        for _round in range(2):
            c0 = time.process_time()
            t0 = time.perf_counter()
            try:
                cands = p.candidates(d, 3)
            except ClusterFull:
                self.cpu += time.process_time() - c0
                self.decisions += 1
                self.cluster_full += 1
                self.failed += 1
                return None
            self.lat.append(time.perf_counter() - t0)
            self.decisions += 1
            self.cpu += time.process_time() - c0
            for v in cands:
                edge = self.by_id[v.edge_id]
                c0 = time.process_time()
                p.reserve(v.edge_id, d)
                self.cpu += time.process_time() - c0
                self.attempts += 1
                ok = edge.admit(d)
                c0 = time.process_time()
                answer = self._answer(edge) if ok else None
                if ok:
                    p.confirm(v.edge_id, d, answer)
                else:
                    p.unreserve(v.edge_id, d)
                    p.refused(v.edge_id, {"running": edge.n, "capacity": edge.capacity})
                self.cpu += time.process_time() - c0
                if ok:
                    self.placed += 1
                    if d.layers and d.layers <= edge.layers:
                        self.local_hits += 1
                    return edge
                self.refusals += 1
        self.failed += 1
        return None

    def release(self, edge: SimEdge, d: Demand, through_api: bool) -> None:
        """A sandbox leaves ``edge``: a stop sent through a random apiserver, which
        tells its Placer (``released``), or, unseen by every apiserver, on the edge."""
        edge.release(d)
        if through_api and self.oracle is None:
            p = self.placers[self.stop_rng.randrange(len(self.placers))]
            c0 = time.process_time()
            answer = self._answer(edge)
            p.released(edge.edge_id, d, answer)
            self.cpu += time.process_time() - c0

    def imbalance(self) -> float:
        return statistics.pstdev(e.load() for e in self.edges)

    def figures(self) -> dict[str, Any]:
        loads = [e.load() for e in self.edges]
        return {
            "decisions": self.decisions,
            "placed": self.placed,
            "failed": self.failed,
            "cluster_full": self.cluster_full,
            "attempts": self.attempts,
            "refusals": self.refusals,
            "rejection_rate": round(self.refusals / max(1, self.attempts), 5),
            "decisions_per_s_per_core": round(self.decisions / self.cpu) if self.cpu else None,
            "p50_us": round(pct(self.lat, 0.5) * 1e6, 1) if self.lat else None,
            "p99_us": round(pct(self.lat, 0.99) * 1e6, 1) if self.lat else None,
            "imbalance_std": round(statistics.pstdev(loads), 5),
            "load_mean": round(statistics.fmean(loads), 4),
            "load_max": round(max(loads), 4),
        }


def demand_mix(rng: random.Random, images: dict[str, frozenset[str]] | None = None) -> Demand:
    base = LARGE if rng.random() < 0.2 else SMALL
    if not images:
        return base
    name = "pop" if rng.random() < 0.5 else f"img{rng.randrange(len(images) - 1)}"
    return Demand(cpu_cores=base.cpu_cores, memory_mb=base.memory_mb, layers=images[name])


def burst(
    name: str, n_edges: int, count: int, apiservers: int, period: float, rate: float, seed: int
) -> dict[str, Any]:
    """``count`` creates arriving at ``rate``/s; the view refreshes every ``period`` s."""
    rng = random.Random(seed)
    edges = make_edges(n_edges, rng, {})
    sim = Sim(edges, name, apiservers=apiservers, period=period, seed=seed)
    for i in range(count):
        sim.advance(i / rate)
        sim.place(demand_mix(rng))
    out = sim.figures()
    out["count"] = count
    out["capacity"] = sum(e.capacity for e in edges)
    return out


def refill(
    name: str, n_edges: int, apiservers: int, period: float, rate: float, seed: int
) -> dict[str, Any]:
    """A job ends on a tenth of the edges of a 90%-full cluster; twice that arrives.

    Every load-aware decider sees the same emptied edges in the stale view; whoever
    sends them more than their room before the next refresh is refused (the herd).
    """
    rng = random.Random(seed)
    edges = make_edges(n_edges, rng, {})
    for e in edges:
        for _ in range(int(0.9 * e.capacity)):
            e.admit(SMALL)
    freed = 0
    for e in rng.sample(edges, max(1, n_edges // 10)):
        for _ in range(int(0.5 * e.capacity)):
            e.release(SMALL)
            freed += 1
    sim = Sim(edges, name, apiservers=apiservers, period=period, seed=seed)
    count = 2 * freed
    for i in range(count):
        sim.advance(i / rate)
        sim.place(SMALL)
    out = sim.figures()
    out["count"] = count
    out["freed"] = freed
    return out


def steady(
    name: str,
    n_edges: int,
    occupancy: float,
    lifetime: float,
    warm_s: float,
    measure_s: float,
    apiservers: int,
    period: float,
    seed: int,
    images: dict[str, frozenset[str]] | None = None,
    locality_weight: float = 0.1,
    stops: Literal["api", "edge"] = "api",
    beat: float | None = None,
) -> dict[str, Any]:
    """Poisson arrivals and exponential lifetimes holding ``occupancy`` of the slots.

    The cluster is prefilled to that occupancy (memoryless lifetimes make that the
    stationary state), then runs ``warm_s`` before measuring for ``measure_s``.
    """
    rng = random.Random(seed)
    edges = make_edges(n_edges, rng, images or {})
    cap = sum(e.capacity for e in edges)
    rate = occupancy * cap / lifetime
    sim = Sim(
        edges,
        name,
        apiservers=apiservers,
        period=period,
        seed=seed,
        locality_weight=locality_weight,
        beat=beat,
    )
    departures: list[tuple[float, int, SimEdge, Demand]] = []
    seq = 0

    def arrive(t: float) -> None:
        nonlocal seq
        sim.advance(t)
        d = demand_mix(rng, images)
        edge = sim.place(d)
        if edge is not None:
            seq += 1
            heapq.heappush(departures, (t + rng.expovariate(1 / lifetime), seq, edge, d))

    for _ in range(int(occupancy * cap)):
        arrive(0.0)
    t = 0.0
    samples: list[float] = []
    measuring = False
    next_sample = warm_s
    while t < warm_s + measure_s:
        t += rng.expovariate(rate)
        while departures and departures[0][0] <= t:
            td, _, edge, dd = heapq.heappop(departures)
            sim.advance(td)
            sim.release(edge, dd, stops == "api")
        if not measuring and t >= warm_s:
            measuring = True
            for k in (
                "decisions",
                "attempts",
                "refusals",
                "cluster_full",
                "placed",
                "failed",
                "local_hits",
            ):
                setattr(sim, k, 0)
            sim.cpu = 0.0
            sim.lat = []
        if measuring and t >= next_sample:
            samples.append(sim.imbalance())
            next_sample += 0.5
        arrive(t)
    out = sim.figures()
    out["imbalance_std_mean"] = round(statistics.fmean(samples), 5) if samples else None
    out["occupancy_target"] = occupancy
    out["rate_per_s"] = round(rate, 1)
    out["lifetime_s"] = lifetime
    if images:
        pop = images["pop"]
        cachers = [e for e in edges if pop <= e.layers]
        loads = [e.load() for e in edges]
        mean = statistics.fmean(loads)
        cl = [e.load() for e in cachers]
        out["locality_hit_rate"] = round(sim.local_hits / max(1, sim.placed), 4)
        out["popular_cachers"] = len(cachers)
        out["hotspot_max_over_mean"] = round(max(cl) / mean, 3) if mean else None
        out["cachers_mean_over_mean"] = round(statistics.fmean(cl) / mean, 3) if mean else None
    return out


#: (name, column header) of the imbalance ratios, in table order
RATIO_COLUMNS: tuple[tuple[str, str], ...] = (
    ("burst_one_apiserver", "burst 1api"),
    ("burst", "burst"),
    ("burst_fast", "burst .5s"),
    ("steady_one_apiserver", "st 1api"),
    ("steady", "steady"),
    ("steady_fast", "st .5s"),
    ("steady_unseen", "unseen"),
    ("steady_unseen_fast", "unseen .5s"),
    ("steady_prod", "st prod"),
    ("steady_prod_unseen", "uns. prod"),
)


def _imb(r: dict[str, Any]) -> float:
    """The imbalance figure of a scenario: end of a burst, mean over a steady run."""
    v = r.get("imbalance_std_mean")
    return float(r["imbalance_std"] if v is None else v)


# Run sizes: edges, burst count, steady lifetime (s), steady warm-up and measured
# window (s) of simulated time. "smoke" is for the test suite (tests/test_placement.py):
# every strategy and scenario, only the output's shape and invariants are checked.
SIZES: dict[str, tuple[int, int, float, tuple[float, float]]] = {
    "full": (160, 32_000, 60.0, (20.0, 60.0)),
    "quick": (40, 4_000, 20.0, (5.0, 10.0)),
    "smoke": (16, 1_000, 8.0, (2.0, 4.0)),
}


def run(size: str = "full", seed: int = 1000) -> dict[str, Any]:
    n_edges, count, life, (warm, meas) = SIZES[size]
    cap = sum(CAPACITIES[i % len(CAPACITIES)] for i in range(n_edges))
    period = 1.0
    fast = 0.5
    rate = 4_000.0
    images = {"pop": frozenset({"sha256:pop-base", "sha256:pop-app"})}
    for i in range(20):
        images[f"img{i}"] = frozenset({f"sha256:base{i % 4}", f"sha256:app{i}"})
    results: dict[str, Any] = {}
    # Common random numbers: every strategy sees the same edges, demands, arrivals and
    # lifetimes, so the ratios compare placement, not luck.
    for name in STRATEGIES:
        omni = STRATEGIES[name][2]
        r: dict[str, Any] = {}
        r["burst"] = burst(name, n_edges, count, 2, period, rate, seed)
        r["refill"] = refill(name, n_edges, 2, period, rate, seed)
        r["overflow"] = burst(name, n_edges, int(cap * 1.1), 2, period, rate, seed)
        args = (name, n_edges, 0.7, life, warm, meas)
        r["steady"] = steady(*args, 2, period, seed, stops="api")
        hot = (name, n_edges, 0.97, life, warm, meas, 2, period, seed)
        r["steady_hot"] = steady(*hot, stops="api")
        if omni:
            # no view, no in-flight state: apiserver count, view period and who saw a
            # departure change nothing, so these would be the very same runs
            for sc in ("burst_one_apiserver", "burst_fast"):
                r[sc] = r["burst"]
            for sc in ("steady_one_apiserver", "steady_fast"):
                r[sc] = r["steady"]
            for sc in ("steady_unseen", "steady_unseen_fast", "steady_prod", "steady_prod_unseen"):
                r[sc] = r["steady"]
            r["steady_hot_unseen"] = r["steady_hot"]
        else:
            r["burst_one_apiserver"] = burst(name, n_edges, count, 1, period, rate, seed)
            r["burst_fast"] = burst(name, n_edges, count, 2, fast, rate, seed)
            r["steady_one_apiserver"] = steady(*args, 1, period, seed, stops="api")
            r["steady_fast"] = steady(*args, 2, fast, seed, stops="api")
            r["steady_unseen"] = steady(*args, 2, period, seed, stops="edge")
            r["steady_unseen_fast"] = steady(*args, 2, fast, seed, stops="edge")
            # as deployed: heartbeats every 0.5 s, each apiserver re-reads every 0.25 s
            prod = (*args, 2, PROD_REFRESH, seed)
            r["steady_prod"] = steady(*prod, stops="api", beat=PROD_BEAT)
            r["steady_prod_unseen"] = steady(*prod, stops="edge", beat=PROD_BEAT)
            r["steady_hot_unseen"] = steady(*hot, stops="edge")
        r["locality"] = steady(
            name, n_edges, 0.5, life, warm, meas, 2, period, seed, images, stops="api"
        )
        if name == "power_of_k2":
            r["locality_off"] = steady(
                name,
                n_edges,
                0.5,
                life,
                warm,
                meas,
                2,
                period,
                seed,
                images,
                locality_weight=0.0,
                stops="api",
            )
        results[name] = r
        print(f"  {name}: done", file=sys.stderr)
    checks: dict[str, dict[str, float]] = {}
    pairs = [
        (n, "least_loaded_omniscient")
        for n in (
            "power_of_k2",
            "power_of_k3",
            "power_of_k5",
            "power_of_k8",
            "power_of_k5_reports_only",
        )
    ]
    pairs += [("least_loaded", "least_loaded_omniscient"), ("power_of_k8", "least_loaded")]
    for name, base in pairs:
        r, ref = results[name], results[base]
        checks[f"{name} / {base}"] = {
            sc: round(_imb(r[sc]) / max(1e-9, _imb(ref[sc])), 2) for sc, _ in RATIO_COLUMNS
        }
    return {
        "config": {
            "quick": size != "full",
            "size": size,
            "seed": seed,
            "edges": n_edges,
            "capacity": cap,
            "burst_count": count,
            "view_period_s": period,
            "fast_view_period_s": fast,
            "burst_rate_per_s": rate,
            "steady_lifetime_s": life,
            "apiservers": 2,
            "candidates_n": 3,
        },
        "strategies": results,
        "imbalance_ratios": checks,
        "targets": {"decisions_per_s_per_core": 2_000, "imbalance_ratio_max": 1.5},
    }


def table(res: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    st = res["strategies"]
    lines = [
        f"{'strategy':<24}{'dec/s/core':>11}{'p50 us':>8}{'p99 us':>8}"
        f"{'steady dec/s':>13}{'st p99 us':>10}"
    ]
    for name, r in st.items():
        b, s = r["burst"], r["steady"]
        lines.append(
            f"{name:<24}{num(b['decisions_per_s_per_core'], ',d'):>11}{b['p50_us']:>8}"
            f"{b['p99_us']:>8}{num(s['decisions_per_s_per_core'], ',d'):>13}{s['p99_us']:>10}"
        )
    lines += [
        "",
        "imbalance = std dev of edge load fraction (end of burst; steady: mean of 0.5 s samples)",
        f"{'strategy':<24}" + "".join(f"{h:>11}" for _, h in RATIO_COLUMNS),
    ]
    for name, r in st.items():
        lines.append(f"{name:<24}" + "".join(f"{_imb(r[sc]):>11.4f}" for sc, _ in RATIO_COLUMNS))
    lines += [
        "",
        "rej = edge refusals / attempts (the herd); hot = 97% occupancy",
        f"{'strategy':<24}{'rej burst':>10}{'rej refill':>11}{'rej hot':>8}{'hot unseen':>11}"
        f"{'refill std':>11}{'overflow placed/full':>22}",
    ]
    for name, r in st.items():
        o = r["overflow"]
        lines.append(
            f"{name:<24}{r['burst']['rejection_rate']:>10.4f}{r['refill']['rejection_rate']:>11.4f}"
            f"{r['steady_hot']['rejection_rate']:>8.4f}"
            f"{r['steady_hot_unseen']['rejection_rate']:>11.4f}{r['refill']['imbalance_std']:>11.4f}"
            f"{str(o['placed']) + '/' + str(o['cluster_full']):>22}"
        )
    lines += [
        "",
        "locality (half the demand is one image cached on 5% of edges, 50% occupancy)",
        f"{'strategy':<24}{'hit rate':>9}{'cacher max/mean':>16}{'cacher mean/mean':>17}",
    ]
    rows = [(n, r["locality"]) for n, r in st.items()]
    rows.append(("power_of_k2 (bonus 0)", st["power_of_k2"]["locality_off"]))
    for name, loc in rows:
        lines.append(
            f"{name:<24}{loc['locality_hit_rate']:>9.3f}{loc['hotspot_max_over_mean']:>16.3f}"
            f"{loc['cachers_mean_over_mean']:>17.3f}"
        )
    lines.append("")
    cfg = res["config"]
    lines += [
        f"imbalance ratios (target <= {res['targets']['imbalance_ratio_max']}x); two apiservers "
        f"unless '1api'; view every {cfg['view_period_s']:g} s, or {cfg['fast_view_period_s']:g} s "
        "('.5s'); steady: stops sent through a random apiserver, 'unseen': departures on the "
        "edges (TTL, crash)",
        f"{'':<52}" + "".join(f"{h:>11}" for _, h in RATIO_COLUMNS),
    ]
    for name, c in res["imbalance_ratios"].items():
        lines.append(f"{name:<52}" + "".join(f"{v:>10.2f}x" for v in c.values()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 edges, a 4,000 burst (seconds)")
    ap.add_argument("--smoke", action="store_true", help="16 edges, a 1,000 burst (the tests)")
    ap.add_argument("--seed", type=int, default=1000, help="another draw of the same runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "placement.json")
    args = ap.parse_args()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    res = run("smoke" if args.smoke else "quick" if args.quick else "full", args.seed)
    res["loadavg"] = {"start": load_start, "end": Path("/proc/loadavg").read_text().split()[:3]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
