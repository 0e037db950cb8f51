"""dsec.edge.warmpool without a platform: what a shape is, when the pool builds,
what it hands out and what it tears down."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsec import DSecContainerRunArgs
from dsec.api.images import ImageInfo
from dsec.api.protected import ProtectedMount
from dsec.api.spec import RunArgs
from dsec.backends.base import BackendFacts
from dsec.edge.warmpool import RESERVE_SECONDS, Warm, WarmPool, shape_of, warm_spec


@dataclass(frozen=True)
class FakeFacts(BackendFacts):
    pid: int | None

    @property
    def init_pid(self) -> int | None:
        return self.pid

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid}


NO_SUCH_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # kill(): ESRCH


def image(digest: str = "sha256:a") -> ImageInfo:
    return ImageInfo(
        name="bb",
        tag="1",
        digest=digest,
        layers=[digest],
        size_bytes=1,
        created_at=datetime.now(UTC),
    )


class Host:
    """What the edge gives the pool: builds and discards recorded, a settable clock."""

    def __init__(self) -> None:
        self.built: list[tuple[str, RunArgs]] = []
        self.discarded: list[str] = []
        self.now = 1000.0
        self.room = True
        self.fail = False
        self.n = 0
        self.live = 1  # the edge's sandboxes that are not ended
        self.discard_fails = 0  # the next this many teardowns fail

    def pool(self, per_shape: int = 1, max_shapes: int = 2) -> WarmPool:
        return WarmPool(
            per_shape=per_shape,
            max_shapes=max_shapes,
            idle_seconds=100.0,
            build=self.build,
            discard=self.discard,
            new_id=self.new_id,
            can_refill=lambda: self.room,
            live=lambda: self.live,
            grace_seconds=5.0,
            clock=lambda: self.now,
        )

    def new_id(self) -> str:
        self.n += 1
        return f"e-{self.n}"

    async def build(self, sid: str, spec: RunArgs, img: ImageInfo) -> BackendFacts:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("crun said no")
        self.built.append((sid, spec))
        return FakeFacts(os.getpid())

    async def discard(self, warm: Warm) -> None:
        if self.discard_fails:
            self.discard_fails -= 1
            raise OSError(24, "Too many open files")
        self.discarded.append(warm.id)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def spec(**kw: Any) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="bb:1", **kw)


def test_the_shape_leaves_out_only_the_edges_bookkeeping() -> None:
    base = shape_of(spec())
    assert base is not None
    same = spec(labels={"a": "b"}, job_id="j", trajectory_id="t", project="p", ttl_running_stop=9)
    assert shape_of(same) == base
    for other in (
        spec(memory_limit_mb=128),
        spec(env={"K": "V"}),
        spec(init_user="nobody"),
        spec(qos="best_effort"),
        spec(workdir="/tmp"),
        spec(disk_limit_mb=100),
        DSecContainerRunArgs(container_image="bb:2"),
    ):
        assert shape_of(other) not in (None, base), other
    # made for one sandbox: never warm
    assert shape_of(spec(network_rules={"pypi": True})) is None
    assert shape_of(spec(protected=[ProtectedMount(path="/grader", files={"a": "b"})])) is None
    # a warm sandbox never carries one caller's labels or job
    warm = warm_spec(same)
    assert (warm.labels, warm.job_id, warm.trajectory_id, warm.project) == ({}, None, None, None)
    assert shape_of(warm) == base


async def test_a_create_fills_its_shape_and_the_next_takes_it() -> None:
    host = Host()
    pool = host.pool()
    assert pool.take(spec()) is None
    pool.asked(spec(labels={"x": "1"}), image(), hit=False)
    await settle()
    assert [sid for sid, _ in host.built] == ["e-1"]
    assert host.built[0][1].labels == {}
    assert pool.take(spec(memory_limit_mb=128)) is None  # another shape
    warm = pool.take(spec(job_id="other"))
    assert warm is not None and warm.id == "e-1"
    assert pool.take(spec()) is None  # handed out once only
    assert await pool.fits(warm, image()) is warm
    assert pool.hits == 1 and pool.misses == 1


async def test_refills_wait_until_no_create_is_in_flight() -> None:
    host = Host()
    pool = host.pool()
    with pool.creating():
        pool.asked(spec(), image(), hit=False)
        await settle()
        assert host.built == []
    await settle()
    assert len(host.built) == 1


async def test_no_refill_without_room_and_a_failed_build_leaves_the_shape_refillable() -> None:
    host = Host()
    pool = host.pool()
    host.room = False
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert host.built == []
    host.room, host.fail = True, True
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert pool.ready_count() == 0
    host.fail = False
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert pool.ready_count() == 1


async def test_a_moved_tag_or_a_dead_init_is_torn_down_not_handed_out() -> None:
    host = Host()
    pool = host.pool()
    pool.asked(spec(), image("sha256:a"), hit=False)
    await settle()
    warm = pool.take(spec())
    assert warm is not None
    assert await pool.fits(warm, image("sha256:b")) is None
    assert host.discarded == [warm.id]
    # the shape's image moved: its warm ones go, new ones come from the new image
    pool.asked(spec(), image("sha256:a"), hit=False)
    await settle()
    pool.asked(spec(), image("sha256:b"), hit=False)
    await settle()
    assert host.discarded[-1] == "e-2" and pool.ready_count() == 1
    # an init that died while warm
    no_such_pid = NO_SUCH_PID
    pool.drain()
    await settle()
    shape = shape_of(spec())
    assert shape is not None
    corpse = Warm("e-dead", shape, FakeFacts(no_such_pid), image("sha256:b"), spec())
    pool.asked(spec(), image("sha256:b"), hit=False)
    await settle()
    taken = pool.take(spec())
    assert taken is not None
    pool.give_back(taken)
    pool.give_back(corpse)  # given back dead: torn down
    await settle()
    assert "e-dead" in host.discarded


async def test_reservations_are_claimed_given_back_or_expire() -> None:
    host = Host()
    pool = host.pool()
    pool.asked(spec(), image(), hit=False)
    await settle()
    sid = pool.reserve(spec())
    assert sid == "e-1" and pool.reserve(spec()) is None
    pool.unreserve(sid)  # the caller's quota said no: back to the shape
    assert pool.reserve(spec()) == sid
    claimed = pool.claim(sid)
    assert claimed is not None and claimed.id == sid and pool.claim(sid) is None
    pool.give_back(claimed)
    assert pool.reserve(spec()) == sid
    host.now += RESERVE_SECONDS + 1  # never claimed: torn down
    pool.expire()
    await settle()
    assert host.discarded == [sid] and pool.ready_count() == 0


async def test_a_named_create_that_failed_holds_its_warm_one_until_the_caller_lets_go() -> None:
    """A named create claims its warm sandbox, then fails (admission said no): the
    sandbox stays held under its id, not handed to the next create, until the caller,
    which charged its quota under that id, has given the charge back and unreserves.
    Handed out at once, the next create charged under the same id while the first
    charge was still on record: 409 already_exists to an innocent create."""
    host = Host()
    pool = host.pool()
    pool.asked(spec(), image(), hit=False)
    await settle()
    sid = pool.reserve(spec())
    claimed = pool.claim(sid) if sid is not None else None
    assert claimed is not None
    pool.hold(claimed)  # the create failed before it used it
    assert pool.reserve(spec()) is None and pool.take(spec()) is None
    pool.unreserve(claimed.id)  # the caller's charge is given back: free again
    assert pool.reserve(spec()) == claimed.id
    # held after the pool closed: torn down, not kept
    again = pool.claim(claimed.id)
    assert again is not None
    await pool.close()
    pool.hold(again)
    await settle()
    assert host.discarded == [claimed.id]


async def test_shapes_nobody_asks_for_go_and_only_the_last_few_are_kept() -> None:
    host = Host()
    pool = host.pool(max_shapes=2)
    for mb in (64, 128, 256):
        pool.asked(spec(memory_limit_mb=mb), image(), hit=False)
        await settle()
    assert pool.ready_count() == 2 and host.discarded == ["e-1"]
    host.now += 101
    pool.expire()
    await settle()
    assert pool.ready_count() == 0 and sorted(host.discarded) == ["e-1", "e-2", "e-3"]


async def test_once_no_sandbox_lives_for_the_grace_every_ready_one_goes() -> None:
    host = Host()
    pool = host.pool()
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert pool.ready_count() == 1
    host.live = 0  # the create's sandbox was stopped, and nothing else runs
    host.now += 4
    pool.expire()
    await settle()
    assert pool.ready_count() == 1  # a loop of create, stop, create pauses shorter
    host.now += 2
    pool.expire()
    await settle()
    assert pool.ready_count() == 0 and host.discarded == ["e-1"]
    # The shape is still known: its next create warms it again, and while sandboxes
    # live the warm one stays however long (up to the shape's idle time).
    pool.asked(spec(), image(), hit=False)
    await settle()
    host.live = 3
    host.now += 50
    pool.expire()
    await settle()
    assert pool.ready_count() == 1
    held = pool.reserve(spec())  # a create about to take it: not torn down under it
    host.live = 0
    host.now += 1
    pool.expire()
    assert pool.claim(held or "") is not None
    pool.asked(spec(), image(), hit=True)
    await settle()
    host.now += 6  # 6 s since the last create ended, none live since
    pool.expire()
    await settle()
    assert pool.ready_count() == 0 and host.discarded == ["e-1", "e-3"]


async def test_a_failed_teardown_is_tried_again_until_it_succeeds() -> None:
    """Out of fds (say), a warm sandbox's teardown fails: it is not forgotten while it
    still exists, but tried again on the next tick and, the last time, at close."""
    host = Host()
    pool = host.pool()
    pool.asked(spec(), image(), hit=False)
    await settle()
    host.discard_fails = 2
    assert pool.drain() == 1
    await settle()
    assert host.discarded == [] and pool.ready_count() == 1  # still there: still counted
    pool.expire()  # one tick of the loop (fails again)
    await settle()
    assert host.discarded == [] and pool.ready_count() == 1
    pool.expire()
    await settle()
    assert host.discarded == ["e-1"] and pool.ready_count() == 0
    # at close: a few rounds, with pauses, before the next start's sweep is left to it
    pool.asked(spec(), image(), hit=False)
    await settle()
    host.discard_fails = 2
    await pool.close()
    assert host.discarded == ["e-1", "e-2"] and pool.ready_count() == 0


async def test_close_tears_down_everything_and_builds_no_more() -> None:
    host = Host()
    pool = host.pool(per_shape=2)
    pool.asked(spec(), image(), hit=False)
    await settle()
    held = pool.reserve(spec())
    with pool.creating():  # a refill waiting for quiet when the edge closes
        pool.asked(spec(), image(), hit=True)
        await pool.close()
    assert held is not None and held in host.discarded
    assert pool.ready_count() == 0
    assert sorted(host.discarded) == sorted(sid for sid, _ in host.built)
    assert pool.take(spec()) is None and pool.reserve(spec()) is None


async def test_a_host_gone_short_hands_out_nothing_warm_and_drains() -> None:
    """A backend decides some things at create time from the host's state (the disk
    guard refuses or clamps): a sandbox started before the shortage must not skip that."""
    host = Host()
    pool = host.pool(per_shape=2)
    pool.asked(spec(), image(), hit=False)
    await settle()
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert pool.ready_count() == 2
    warm = pool.take(spec())
    assert warm is not None
    host.room = False
    assert await pool.fits(warm, image()) is None
    await settle()
    assert pool.ready_count() == 0 and len(host.discarded) == 2
    host.room = True
    pool.asked(spec(), image(), hit=False)
    await settle()
    assert pool.ready_count() == 1


async def test_a_warm_sandbox_from_an_older_generation_is_torn_down() -> None:
    host = Host()
    generation = [0]
    pool = WarmPool(
        per_shape=1,
        max_shapes=2,
        idle_seconds=100.0,
        build=host.build,
        discard=host.discard,
        new_id=host.new_id,
        can_refill=lambda: True,
        generation=lambda: generation[0],
    )
    pool.asked(spec(), image(), hit=False)
    await settle()
    warm = pool.take(spec())
    assert warm is not None
    generation[0] += 1  # e.g. the seccomp listener restarted
    assert await pool.fits(warm, image()) is None
    assert host.discarded == [warm.id]
    pool.asked(spec(), image(), hit=False)
    await settle()
    fresh = pool.take(spec())
    assert fresh is not None and await pool.fits(fresh, image()) is fresh


async def test_a_create_cancelled_while_its_warm_one_is_torn_down_finishes_the_teardown() -> None:
    host = Host()
    release = asyncio.Event()
    done = host.discard

    async def slow_discard(warm: Warm) -> None:
        await release.wait()
        await done(warm)

    host.discard = slow_discard  # type: ignore[method-assign]
    pool = host.pool()
    pool.asked(spec(), image("sha256:a"), hit=False)
    await settle()
    warm = pool.take(spec())
    assert warm is not None
    create = asyncio.ensure_future(pool.fits(warm, image("sha256:b")))  # the tag moved
    await settle()
    create.cancel()
    await settle()
    release.set()
    await pool.close()
    assert warm.id in host.discarded and pool.ready_count() == 0


def layered(*layers: str) -> ImageInfo:
    return image(layers[-1]).model_copy(update={"layers": list(layers)})


async def test_the_layer_cache_gets_back_only_layers_warm_sandboxes_alone_hold() -> None:
    host = Host()
    pool = host.pool(max_shapes=3)
    one, two = layered("sha256:base", "sha256:one"), layered("sha256:base", "sha256:two")
    pool.asked(spec(), one, hit=False)
    pool.asked(spec(memory_limit_mb=128), two, hit=False)
    await settle()
    pool.asked(spec(memory_limit_mb=256), two, hit=False)
    await settle()
    assert pool.ready_count() == 3
    reserved = pool.reserve(spec(memory_limit_mb=256))
    assert reserved is not None
    # base: also a running sandbox's (4 users, warm ones hold 3); one: only the warm
    # one's; two: warm ones' only (the ready one and the reserved one)
    assert pool.let_go({"sha256:base": 4}) == 0
    assert host.discarded == []
    assert pool.let_go({"sha256:one": 1, "sha256:two": 3}) == 1  # two: a sandbox too
    await settle()
    assert host.discarded == ["e-1"]
    # its shape is forgotten: the next create of it misses and asks again
    assert pool.take(spec()) is None
    pool.asked(spec(), one, hit=False)
    await settle()
    assert pool.take(spec()) is not None
    # two, held by warm ones alone: the ready one goes, the reserved one stays
    assert pool.let_go({"sha256:two": 2}) == 1
    await settle()
    assert len(host.discarded) == 2 and reserved not in host.discarded
    assert pool.claim(reserved) is not None
