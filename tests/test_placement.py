"""Placement engine (dsec.control.placement): filter, rank, in-flight view, locality.

Pure Python with an injected clock, so these run in milliseconds; performance lives in
bench/bench_placement.py (run here only with --smoke, for its output shape).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.api.spec import BackendKind, DSecContainerRunArgs
from dsec.control.placement import Demand, EdgeLoad, EdgeView, Placer
from dsec.errors import ClusterFull, InvalidArgument

REPO = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def edge(i: int, **kw: object) -> EdgeView:
    fields: dict[str, object] = {
        "capacity": 10,
        "cpu_cores": 16.0,
        "memory_mb": 32768,
        "labels": {"zone": "a"},
        "seen_at": 50.0,
        "backends": frozenset({BackendKind.CONTAINER.value}),
    }
    fields.update(kw)
    return EdgeView(f"e{i}", f"http://e{i}:8471", **fields)  # type: ignore[arg-type]


def placer(views: list[EdgeView], clock: Clock | None = None, **kw: object) -> Placer:
    p = Placer(rng=random.Random(7), clock=clock or Clock(), **kw)  # type: ignore[arg-type]
    p.update(views)
    return p


def test_filter_reasons_and_cluster_full_details() -> None:
    views = [
        edge(0, up=False),
        edge(1, backends=frozenset({"fncall"})),
        edge(2, labels={"zone": "b"}),
        edge(3, sandboxes=10),
        edge(4, cpu_committed=15.5),
        edge(5, memory_committed_mb=32000),
    ]
    p = placer(views)
    d = Demand(cpu_cores=1.0, memory_mb=1024, selector={"zone": "a"})
    with pytest.raises(ClusterFull) as exc:
        p.candidates(d)
    err = exc.value
    assert err.status == 503 and err.code == "cluster_full"
    det = err.details
    assert det["reasons"] == {
        "down": 1,
        "backend": 1,
        "selector": 1,
        "sandboxes": 1,
        "cpu": 1,
        "memory": 1,
    }
    assert det["edges"] == 6 and det["edges_up"] == 5
    assert det["capacity"] == 50 and det["sandboxes"] == 10
    assert det["cpu_free"] == pytest.approx(16 * 5 - 15.5)
    assert det["memory_free_mb"] == 32768 * 5 - 32000
    assert "filtered out by" in err.message
    # an empty view is a ClusterFull too, not an IndexError
    with pytest.raises(ClusterFull) as exc:
        placer([]).candidates(Demand())
    assert exc.value.details["edges_up"] == 0


def test_required_image_filters_unless_the_edge_loads_lazily() -> None:
    img = frozenset({"image:busybox:latest"})
    views = [edge(0), edge(1, layers=img), edge(2, lazy=True)]
    p = placer(views)
    got = {v.edge_id for v in p.candidates(Demand(requires=img, layers=img), n=3)}
    assert got == {"e1", "e2"}
    p.update([edge(0)])
    with pytest.raises(ClusterFull) as info:
        p.candidates(Demand(requires=img))
    assert info.value.details["reasons"]["image"] == 1


def test_candidates_only_eligible_distinct_ordered() -> None:
    views = [edge(i, sandboxes=i) for i in range(8)] + [edge(8, labels={"zone": "b"})]
    for strategy in ("power_of_k", "least_loaded", "random"):
        p = placer(views, strategy=strategy)
        for _ in range(50):
            got = p.candidates(Demand(selector={"zone": "a"}), n=3)
            ids = [v.edge_id for v in got]
            assert len(ids) == 3 and len(set(ids)) == 3 and "e8" not in ids
    p = placer(views, strategy="least_loaded")
    got = p.candidates(Demand(selector={"zone": "a"}), n=3)
    assert [v.edge_id for v in got] == ["e0", "e1", "e2"]
    # fewer edges with room than asked: what there is, not an error
    assert len(placer(views[:2]).candidates(Demand(), n=5)) == 2


def test_load_is_the_scarcest_resource() -> None:
    views = [
        edge(0, sandboxes=1, memory_committed_mb=30000),  # few sandboxes, memory nearly gone
        edge(1, sandboxes=5),
    ]
    p = placer(views, strategy="least_loaded")
    assert p.load("e0") == pytest.approx(30000 / 32768)
    assert p.candidates(Demand(memory_mb=512))[0].edge_id == "e1"


def test_demand_for_spec_selector() -> None:
    spec = DSecContainerRunArgs(
        container_image="busybox:latest",
        cpu_cores_limit=2,
        memory_limit_mb=2048,
        labels={"edge.zone": "a", "edge.gpu": "h800", "team": "rl"},
    )
    d = Demand.for_spec(spec, "container", frozenset({"sha256:x"}))
    assert d == Demand(
        "container", 2.0, 2048, frozenset({"sha256:x"}), {"zone": "a", "gpu": "h800"}
    )
    bad = DSecContainerRunArgs(container_image="busybox:latest", labels={"edge.": "x"})
    with pytest.raises(InvalidArgument):
        Demand.for_spec(bad, "container")
    with pytest.raises(InvalidArgument):
        Placer(strategy="nope")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        placer([edge(0)]).candidates(Demand(), n=0)


def test_reservations_counted_then_superseded_not_double_counted() -> None:
    clock = Clock()
    p = placer([edge(0, capacity=3)], clock)
    d = Demand()
    clock.t = 101.0
    p.reserve("e0", d)
    p.reserve("e0", d)
    p.reserve("e0", d)
    assert p.reserved("e0") == 3
    with pytest.raises(ClusterFull) as exc:
        p.candidates(d)
    assert exc.value.details["reasons"] == {"sandboxes": 1}
    # a report taken before the reservations does not include them: still counted
    p.update([edge(0, capacity=3, sandboxes=1, seen_at=100.5)])
    assert p.reserved("e0") == 3
    with pytest.raises(ClusterFull):
        p.candidates(d)
    # one create failed: no longer counted
    p.unreserve("e0", d)
    assert p.reserved("e0") == 2
    assert p.load("e0") == pytest.approx(3 / 3)
    # a report taken after them includes the two that landed: dropped, not double-counted
    p.update([edge(0, capacity=3, sandboxes=2, seen_at=102.0)])
    assert p.reserved("e0") == 0
    assert p.load("e0") == pytest.approx(2 / 3)
    assert p.candidates(d)[0].edge_id == "e0"
    # unreserve after the view superseded it is a no-op (never negative)
    p.unreserve("e0", d)
    assert p.load("e0") == pytest.approx(2 / 3)


def test_confirm_restamps_so_an_in_between_report_does_not_forget() -> None:
    clock = Clock()
    p = placer([edge(0, capacity=1)], clock)
    d = Demand()
    clock.t = 101.0
    p.reserve("e0", d)
    clock.t = 103.0
    p.confirm("e0", d)  # the edge admitted it at ~102.9
    # the edge's report taken at 102 (after reserve, before admission) lacks it
    p.update([edge(0, capacity=1, sandboxes=0, seen_at=102.0)])
    assert p.reserved("e0") == 1
    with pytest.raises(ClusterFull):
        p.candidates(d)
    p.update([edge(0, capacity=1, sandboxes=1, seen_at=103.5)])
    assert p.reserved("e0") == 0


def test_edge_load_header_round_trip_and_garbage() -> None:
    load = EdgeLoad(seq=1764500000123456, sandboxes=7, memory_committed_mb=7168, cpu_committed=3.5)
    assert EdgeLoad.parse(load.header()) == load
    for bad in (None, "", "seq=1", "seq=x;n=1;mem=1;cpu=1", "seq=0;n=1;mem=1;cpu=1",
                "seq=5;n=-1;mem=1;cpu=1", "seq=5;n=1;mem=1;cpu=nan", "garbage"):  # fmt: skip
        assert EdgeLoad.parse(bad) is None, bad
    # unknown fields (a newer edge) are ignored
    assert EdgeLoad.parse(load.header() + ";gpu=2") == load


def test_piggybacked_load_ordered_by_sequence_never_double_counted() -> None:
    """An edge's answers carry its usage (others' creates included); sequences, not
    arrival order, decide which figures hold and which own creates they include."""
    clock = Clock()
    cap = 10
    p = placer([edge(0, capacity=cap, sandboxes=2, seq=100, seen_at=100.0)], clock)
    d = Demand(cpu_cores=1.0, memory_mb=1024)
    clock.t = 101.0
    p.reserve("e0", d)
    p.reserve("e0", d)  # two creates in flight
    # the first answer: usage 6 at seq 105 (ours, and three of another apiserver's, and
    # perhaps our second): the second, still unanswered, stays counted (never forgotten)
    p.confirm("e0", d, EdgeLoad(105, 6, 6144, 6.0))
    assert p.reserved("e0") == 1
    assert p.load("e0") == pytest.approx(7 / cap)
    # the second answer overtaken by the first (seq 103 < 105): its create is in the
    # newer figures, so it stops counting, and the older figures change nothing
    p.confirm("e0", d, EdgeLoad(103, 5, 5120, 5.0))
    assert p.reserved("e0") == 0
    assert p.load("e0") == pytest.approx(6 / cap)
    # a heartbeat older than the answer (by sequence, however late it arrives) does not
    # bring the old figures back
    clock.t = 102.0
    p.update([edge(0, capacity=cap, sandboxes=4, seq=104, seen_at=102.0)])
    assert p.load("e0") == pytest.approx(6 / cap)
    assert p.views()[0].sandboxes == 6 and p.views()[0].capacity == cap
    # our stop's answer includes the departure (and another stop elsewhere): no negative
    # reservation left over to count it twice
    p.released("e0", d, EdgeLoad(107, 4, 4096, 4.0))
    assert p.load("e0") == pytest.approx(4 / cap)
    p.update([edge(0, capacity=cap, sandboxes=5, seq=106, seen_at=102.5)])
    assert p.load("e0") == pytest.approx(4 / cap)
    # a newer heartbeat wins
    p.update([edge(0, capacity=cap, sandboxes=3, seq=108, seen_at=103.0)])
    assert p.load("e0") == pytest.approx(3 / cap)
    # an answer without the header (an older edge): time rules, as without sequences
    p.reserve("e0", d)
    clock.t = 104.0
    p.confirm("e0", d, None)
    p.reserve("e0", d)
    p.confirm("e0", d, EdgeLoad(110, 5, 5120, 5.0))
    assert p.reserved("e0") == 1  # the header-less one: only a later report drops it
    p.update([edge(0, capacity=cap, sandboxes=4, seq=109, seen_at=105.0)])
    assert p.reserved("e0") == 0
    assert p.load("e0") == pytest.approx(5 / cap)  # seq 110 still newest


def test_piggybacked_load_distrusted_when_reports_stay_behind() -> None:
    """Sequences start at the edge's clock: should a restart step them back, a newer
    report wins once the answer's figures are older than _SNAP_TRUST_S."""
    clock = Clock()
    p = placer([edge(0, capacity=10, sandboxes=1, seq=100, seen_at=100.0)], clock)
    p.observe("e0", EdgeLoad(10**9, 9, 9216, 9.0))
    p.update([edge(0, capacity=10, sandboxes=2, seq=200, seen_at=100.5)])
    assert p.load("e0") == pytest.approx(9 / 10)
    clock.t += 3.0
    p.update([edge(0, capacity=10, sandboxes=2, seq=300, seen_at=102.5)])
    assert p.load("e0") == pytest.approx(2 / 10)
    # an answer for an edge not in the view yet is kept for when it is
    p.observe("e1", EdgeLoad(50, 3, 3072, 3.0))
    p.update([edge(0, seq=300, seen_at=103.0), edge(1, capacity=10, seq=40, seen_at=103.0)])
    assert p.load("e1") == pytest.approx(3 / 10)


def test_reservation_ttl_drops_leaks() -> None:
    clock = Clock()
    p = placer([edge(0)], clock, reservation_ttl=30.0)
    p.reserve("e0", Demand())
    clock.t += 31
    p.update([edge(0, seen_at=50.0)])  # edge reports stuck in the past
    assert p.reserved("e0") == 0


def test_peer_factor_scores_other_apiservers_in_flight_but_never_filters() -> None:
    clock = Clock()
    views = [edge(i, capacity=100, cpu_cores=0, memory_mb=0) for i in range(4)]
    p = placer(views, clock)
    assert p.peer_factor == 1.0
    clock.t = 101.0
    for i in range(20):
        p.reserve(f"e{i % 4}", Demand())
    # the next reports hold our 20 and 20 more from another apiserver
    p.update(
        [
            edge(i, capacity=100, cpu_cores=0, memory_mb=0, sandboxes=10, seen_at=102.0)
            for i in range(4)
        ]
    )
    assert p.reserved("e0") == 0
    assert p.peer_factor == pytest.approx(2.0)
    p.reserve("e0", Demand())
    assert p.load("e0") == pytest.approx(12 / 100)  # 10 reported + ours + one peer estimate
    # the room check counts only real creates: an edge with one slot left stays eligible
    p.update([edge(0, capacity=11, sandboxes=10, seen_at=103.0)])
    p.reserve("e0", Demand())
    p.unreserve("e0", Demand())
    assert [v.edge_id for v in p.candidates(Demand())] == ["e0"]


def test_released_counts_a_departure_until_a_newer_report() -> None:
    clock = Clock()
    p = placer([edge(0, capacity=2, sandboxes=2), edge(1, capacity=2, sandboxes=1)], clock)
    d = Demand()
    clock.t = 101.0
    p.refused("e0", {"running": 2, "capacity": 2})
    clock.t = 102.0
    p.released("e0", d)  # our stop: a slot is free before any report says so
    assert p.load("e0") == pytest.approx(1 / 2)
    assert "e0" in {v.edge_id for v in p.candidates(d, n=2)}  # also lifts the refusal
    # a report older than the stop still has the sandbox: the release stays counted
    p.update([edge(0, capacity=2, sandboxes=2, seen_at=101.5)])
    assert p.load("e0") == pytest.approx(1 / 2)
    # a report taken after it includes the departure: dropped, not double-counted
    p.update([edge(0, capacity=2, sandboxes=1, seen_at=102.5)])
    assert p.load("e0") == pytest.approx(1 / 2)
    # a release the reports never confirm (lost) expires like a reservation
    p.released("e0", d)
    p.released("e0", d)  # more than there is: load never drops below zero
    assert p.load("e0") == 0.0
    clock.t += 61
    p.update([edge(0, capacity=2, sandboxes=1, seen_at=102.5)])
    assert p.load("e0") == pytest.approx(1 / 2)


def test_own_departures_are_candidates_for_the_next_create() -> None:
    views = [edge(i, capacity=100, cpu_cores=0, memory_mb=0, sandboxes=50) for i in range(200)]
    p = placer(views, k=2)
    d = Demand()
    for i in (17, 123):
        p.released(f"e{i}", d)
        # 2 random samples of 200 would rarely find it; the freed slot is offered
        first = p.candidates(d)[0].edge_id
        assert first == f"e{i}"
        p.reserve(first, d)
    # a freed slot the filter excludes is skipped, not offered
    p.released("e5", d)
    p.refused("e5", {})
    assert p.candidates(d)[0].edge_id != "e5"


def test_one_apiserver_takes_at_most_its_share_of_an_edges_room() -> None:
    # e0 looks half empty, e1 nearly full; we alone must not pour all of e0's room
    # in before the next report (another apiserver sees the same hole)
    views = [edge(0, capacity=20, sandboxes=10), edge(1, capacity=100, sandboxes=90)]
    p = placer(views, k=2)
    d = Demand()
    picks = []
    for _ in range(8):
        first = p.candidates(d, n=2)[0].edge_id
        picks.append(first)
        p.reserve(first, d)
    assert picks[:6] == ["e0"] * 6  # up to half of its 10 free slots (and one over)
    assert picks[6:] == ["e1", "e1"]
    # a score, never a filter: e0 stays a candidate with its real room
    assert {v.edge_id for v in p.candidates(d, n=2)} == {"e0", "e1"}


def test_refused_edge_skipped_until_next_report() -> None:
    clock = Clock()
    views = [edge(0), edge(1, sandboxes=5)]
    p = placer(views, clock, strategy="least_loaded")
    assert p.candidates(Demand())[0].edge_id == "e0"
    clock.t = 101.0
    p.refused("e0", {"running": 10, "capacity": 10})
    assert [v.edge_id for v in p.candidates(Demand())] == ["e1"]
    assert p.refusals["e0"]["running"] == 10
    p.update(views)  # the same old report again: still refused
    assert [v.edge_id for v in p.candidates(Demand())] == ["e1"]
    p.update([edge(0, seen_at=102.0), edge(1, sandboxes=5, seen_at=102.0)])
    assert p.candidates(Demand())[0].edge_id == "e0"
    with pytest.raises(ClusterFull) as exc:
        clock.t = 103.0
        p.refused("e0", {})
        p.refused("e1", {})
        p.candidates(Demand())
    assert exc.value.details["reasons"] == {"refused": 2}


def test_locality_prefers_cached_edges_without_hot_spot() -> None:
    layers = frozenset({"sha256:base", "sha256:app"})
    views = [
        edge(i, capacity=100, cpu_cores=0, memory_mb=0, layers=layers if i < 2 else frozenset())
        for i in range(40)
    ]
    d = Demand(layers=layers)
    p = placer(views, locality_weight=0.1)
    hits = []
    for _ in range(1000):
        first = p.candidates(d)[0]
        hits.append(first.edge_id in ("e0", "e1"))
        p.reserve(first.edge_id, d)
    # on an even cluster the cached edges (5% of them) win ...
    assert all(hits[:20])
    # ... but never more than ~locality_weight fuller than the rest
    loads = {v.edge_id: p.load(v.edge_id) for v in views}
    others = [x for k, x in loads.items() if k not in ("e0", "e1")]
    mean_others = sum(others) / len(others)
    assert max(loads["e0"], loads["e1"]) <= mean_others + 0.1 + 0.05
    # without the bonus, cached edges get their plain share
    p0 = placer(views, locality_weight=0.0)
    hits0 = 0
    for _ in range(1000):
        first = p0.candidates(d)[0]
        hits0 += first.edge_id in ("e0", "e1")
        p0.reserve(first.edge_id, d)
    assert hits0 < sum(hits)


def test_deterministic_with_seeded_rng() -> None:
    views = [edge(i, sandboxes=i % 4) for i in range(30)]

    def run(seed: int) -> list[str]:
        p = Placer(rng=random.Random(seed), clock=Clock(), k=2)
        p.update(views)
        out = []
        for _ in range(100):
            first = p.candidates(Demand())[0]
            out.append(first.edge_id)
            p.reserve(first.edge_id, Demand())
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_bench_quick_reports_every_strategy(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_placement.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    strategies = res["strategies"]
    assert set(strategies) == {
        "random",
        "least_loaded",
        "power_of_k2",
        "power_of_k3",
        "power_of_k5",
        "power_of_k8",
        "power_of_k5_reports_only",
        "least_loaded_omniscient",
    }
    for name, r in strategies.items():
        for scenario in (
            "burst",
            "burst_one_apiserver",
            "burst_fast",
            "refill",
            "overflow",
            "steady",
            "steady_one_apiserver",
            "steady_fast",
            "steady_unseen",
            "steady_unseen_fast",
            "steady_hot_unseen",
            "steady_prod",
            "steady_prod_unseen",
        ):
            assert r[scenario]["decisions"] > 0, (name, scenario)
            assert "imbalance_std" in r[scenario] and "rejection_rate" in r[scenario]
        assert r["overflow"]["cluster_full"] > 0
        assert r["overflow"]["placed"] >= 0.97 * res["config"]["capacity"]
        assert "hotspot_max_over_mean" in r["locality"]
    assert strategies["power_of_k2"]["burst"]["decisions_per_s_per_core"] > 0
    assert "power_of_k2" in proc.stdout
    ratios = res["imbalance_ratios"]["power_of_k3 / least_loaded_omniscient"]
    assert {"steady", "steady_fast", "steady_unseen", "steady_unseen_fast"} <= set(ratios)
