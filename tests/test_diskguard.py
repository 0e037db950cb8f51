"""The host-space guard's arithmetic and its clamp / re-share / restore cycle, with the
host's free space and the quota groups played by the test (the real thing, on a
filled-up data dir, is tests/faults/test_exhaustion.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.errors import InsufficientStorage
from dsec.exhaustion import Exhaustion, Resource
from dsec.resources.diskguard import (
    COW_FACTOR,
    MIN_RESERVE,
    HostSpace,
    HostSpaceGuard,
    clamped_limits,
    reserve_for,
    share,
    slack_for,
)

MiB = 1024 * 1024
GiB = 1024 * MiB


def test_reserve_is_at_least_512_mib_and_2_percent_of_the_image() -> None:
    assert reserve_for(1 * GiB) == MIN_RESERVE == 512 * MiB
    assert reserve_for(100 * GiB) == 2 * GiB
    assert slack_for(512 * MiB) == 128 * MiB
    assert slack_for(100 * MiB) == 64 * MiB


def test_short_only_when_free_space_cannot_back_the_growth_plus_reserve() -> None:
    r = 512 * MiB
    assert not HostSpace(growth=1 * GiB, free=1 * GiB + r, reserve=r).short
    assert HostSpace(growth=1 * GiB, free=1 * GiB + r - 1, reserve=r).short
    # recovered needs the slack on top: no flapping at the threshold
    at = HostSpace(growth=1 * GiB, free=1 * GiB + r, reserve=r)
    assert not at.recovered()
    assert HostSpace(growth=1 * GiB, free=1 * GiB + r + slack_for(r), reserve=r).recovered()
    assert HostSpace(growth=0, free=100 * MiB, reserve=r).budget == 0
    assert HostSpace(growth=0, free=r + 300 * MiB, reserve=r).budget == 300 * MiB


def test_clamped_limits_share_the_budget_and_never_exceed_the_configured_limit() -> None:
    budget = 400 * MiB
    each = budget // (COW_FACTOR * 4)
    assert share(budget, 4) == each == 50 * MiB
    limits = clamped_limits(
        budget,
        {
            "a": (10 * MiB, 1 * GiB),  # gets its share on top of what it has
            "b": (0, 20 * MiB),  # its own limit is lower than the share
            "c": (900 * MiB, 1 * GiB),  # near its limit: capped there
            "d": (5 * MiB, 0),  # no configured limit: the share alone
        },
    )
    assert limits == {
        "a": 60 * MiB,
        "b": 20 * MiB,
        "c": 950 * MiB,
        "d": 55 * MiB,
    }
    # Everything the clamped sandboxes may still write, times the COW factor, fits.
    headroom = sum(limits[k] - used for k, used in (("a", 10 * MiB), ("d", 5 * MiB)))
    assert headroom * COW_FACTOR <= budget
    # No budget: each is held at what it has.
    assert clamped_limits(0, {"a": (10 * MiB, GiB)}) == {"a": 10 * MiB}
    assert share(100, 0) == 50  # no sandbox: no division by zero


class FakeHost:
    """The guard's world: free space, growth and quota groups, as the test says."""

    def __init__(self) -> None:
        self.space = HostSpace(growth=1 * GiB, free=3 * GiB, reserve=512 * MiB)
        self.used: dict[int, int] = {}
        self.limits: dict[int, int] = {}
        self.gone: set[int] = set()
        self.calls: list[int] = []  # every limit the guard set
        self.refuse: set[int] = set()  # quota groups whose limit cannot be set now

    def set_limit(self, path: Path, qgroup: int, limit: int) -> None:
        if qgroup in self.gone:
            raise FileNotFoundError(path)
        if qgroup in self.refuse:
            raise OSError(122, "Disk quota exceeded")
        self.calls.append(limit)
        self.limits[qgroup] = limit

    def read_used(self, qgroup: int) -> int | None:
        return None if qgroup in self.gone else self.used.get(qgroup, 0)

    def guard(self) -> HostSpaceGuard:
        return HostSpaceGuard(
            Path("/data/sandboxes.img"),
            set_limit=self.set_limit,
            read_used=self.read_used,
            look=lambda _image: self.space,
        )

    def admit(self, guard: HostSpaceGuard, qgroup: int, configured: int) -> None:
        self.limits[qgroup] = guard.admit(Path(f"/s/{qgroup}"), qgroup, configured)


def test_guard_clamps_reshares_admits_and_restores() -> None:
    host = FakeHost()
    g = host.guard()
    host.admit(g, 256, 1 * GiB)
    host.admit(g, 257, 1 * GiB)
    g.tick()  # plenty of room: nothing touched
    assert not g.clamped and g.reason is None
    assert host.limits == {256: GiB, 257: GiB}

    # The host fills up: 300 MiB above the reserve, two sandboxes -> 75 MiB each.
    host.used = {256: 100 * MiB, 257: 0}
    host.space = HostSpace(growth=1 * GiB, free=812 * MiB, reserve=512 * MiB)
    g.tick()
    assert g.clamped and g.reason and "812 MiB free" in g.reason
    assert host.limits == {256: 175 * MiB, 257: 75 * MiB}

    # A new sandbox while clamped gets a clamped limit right away (a third's share).
    host.admit(g, 258, 1 * GiB)
    assert host.limits[258] == 50 * MiB
    host.admit(g, 259, 10 * MiB)  # and never more than its own limit
    assert host.limits[259] == 10 * MiB

    # Space shrinks: limits tighten at once, to used + the new share.
    host.space = HostSpace(growth=1 * GiB, free=512 * MiB + 80 * MiB, reserve=512 * MiB)
    g.tick()
    assert host.limits == {256: 110 * MiB, 257: 10 * MiB, 258: 10 * MiB, 259: 10 * MiB}

    # A sandbox removed meanwhile (its subvolume gone) is skipped, not an error.
    host.gone.add(257)
    g.tick()
    g.forget(Path("/s/257"))
    assert Path("/s/257").as_posix() not in g.limits()

    # Back above the threshold but within the slack: still clamped (hysteresis).
    host.space = HostSpace(growth=1 * GiB, free=1 * GiB + 512 * MiB + MiB, reserve=512 * MiB)
    g.tick()
    assert g.clamped
    # Past the slack: the configured limits come back, and new ones get theirs.
    host.space = HostSpace(growth=1 * GiB, free=3 * GiB, reserve=512 * MiB)
    g.tick()
    assert not g.clamped and g.reason is None
    assert {q: host.limits[q] for q in (256, 258, 259)} == {256: GiB, 258: GiB, 259: 10 * MiB}
    host.admit(g, 260, 1 * GiB)
    assert host.limits[260] == GiB


def test_guard_loosens_only_by_a_margin() -> None:
    """While clamped, a limit follows usage up only in steps (not an ioctl a tick)."""
    host = FakeHost()
    g = host.guard()
    host.admit(g, 256, 4 * GiB)
    host.space = HostSpace(growth=1 * GiB, free=512 * MiB + 400 * MiB, reserve=512 * MiB)
    g.tick()
    assert host.limits[256] == 200 * MiB
    host.calls.clear()
    host.used[256] = 1 * MiB  # a little more usage, the same budget: not worth an ioctl
    g.tick()
    assert host.calls == []
    host.used[256] = 100 * MiB  # a lot more: re-shared
    g.tick()
    assert host.calls == [300 * MiB]


def test_health_shows_the_clamp_and_clears_with_it(tmp_path: Path) -> None:
    reason: list[str | None] = [None]
    ex = Exhaustion(tmp_path)
    ex.watch(Resource.SANDBOX_DISK, lambda: reason[0])
    assert [c.resource for c in ex.conditions()] == []
    reason[0] = "clamped"
    (cond,) = ex.conditions()
    assert cond.resource is Resource.SANDBOX_DISK and cond.detail == "clamped"
    assert cond.as_dict()["what_to_do"]
    ex.check_create()  # a clamp alone does not refuse creates
    reason[0] = None
    assert ex.conditions() == []  # gone with the clamp, no quiet period


@pytest.mark.parametrize("configured", [0, 5 * MiB])
def test_admit_unclamped_is_the_configured_limit(configured: int) -> None:
    host = FakeHost()
    g = host.guard()
    assert g.admit(Path("/s/1"), 1, configured) == configured


def test_one_failing_limit_does_not_stop_the_others_and_is_retried() -> None:
    host = FakeHost()
    g = host.guard()
    host.admit(g, 256, 1 * GiB)
    host.admit(g, 257, 1 * GiB)
    host.refuse.add(256)
    host.space = HostSpace(growth=1 * GiB, free=512 * MiB + 400 * MiB, reserve=512 * MiB)
    g.tick()
    assert host.limits == {256: GiB, 257: 100 * MiB}  # 256 refused, 257 clamped anyway
    host.refuse.clear()
    g.tick()
    assert host.limits == {256: 100 * MiB, 257: 100 * MiB}


def test_creates_are_refused_only_when_a_new_share_would_be_too_small() -> None:
    host = FakeHost()
    g = host.guard()
    g.check_room()  # not clamped: always room
    host.admit(g, 256, 1 * GiB)
    host.space = HostSpace(growth=1 * GiB, free=512 * MiB + 200 * MiB, reserve=512 * MiB)
    g.tick()
    g.check_room()  # 200 MiB between two: 50 MiB each
    host.space = HostSpace(growth=1 * GiB, free=512 * MiB + 40 * MiB, reserve=512 * MiB)
    g.tick()
    with pytest.raises(InsufficientStorage) as err:
        g.check_room()  # 40 MiB between two: 10 MiB each, below MIN_SHARE
    assert err.value.status == 507 and "free space" in err.value.message
    host.space = HostSpace(growth=1 * GiB, free=3 * GiB, reserve=512 * MiB)
    g.tick()
    g.check_room()
