"""Warm sandboxes (dsec.edge.warmpool) on a real platform: a create after a create of
the same shape gets a container started ahead, never used by anyone, with its own
caller's labels and limits; one that died while warm, or whose image's tag moved, is
not handed out; nothing is left when the platform stops, is killed, or a quota
refuses the create a warm sandbox was held for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient, LayerRef, linux
from dsec.errors import DSecError
from dsec.resources import cgroups
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (crun)")


# These tests look at warm sandboxes after stopping every sandbox they made: the grace
# after which an edge with no live sandbox lets its warm ones go is long here (it has
# its own test below).
KEEP_WARM = {"DSEC_WARM_POOL": "1", "DSEC_WARM_GRACE_SECONDS": "600"}


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process(**KEEP_WARM) as p:
        with DSecSyncClient(p.url, p.api_key) as c:
            c.build_image("busybox")
        yield p


@pytest.fixture
async def client(plat: PlatformProcess) -> AsyncIterator[DSecClient]:
    c = DSecClient(plat.url, plat.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


def metric(plat: PlatformProcess, name: str) -> float:
    text = httpx.get(
        f"{plat.url}/metrics", headers={"Authorization": f"Bearer {plat.api_key}"}, timeout=5
    ).text
    found = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def unexplained(plat: PlatformProcess, client: DSecClient) -> set[str]:
    """Sandbox directories no sandbox explains: the warm ones."""
    live = {sb.id for sb in await client.list_sandboxes()}
    return {p.name for p in (plat.data_dir / "sandboxes").iterdir() if p.is_dir()} - live


async def warm_ids(
    plat: PlatformProcess, client: DSecClient, since: set[str] | None = None
) -> set[str]:
    """The warm sandboxes started since ``since`` was taken, once there is one."""
    deadline = time.monotonic() + 30
    while True:
        warm = await unexplained(plat, client) - (since or set())
        if warm and metric(plat, "dsec_warm_sandboxes") >= 1:
            return warm
        assert time.monotonic() < deadline, "no warm sandbox started"
        await asyncio.sleep(0.05)


def init_pids(plat: PlatformProcess, sid: str) -> set[int]:
    return cgroups.detect().pids(f"/dsec/{plat.edge_id}/{sid}")


def args(**kw: object) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 64)
    return DSecContainerRunArgs(container_image="busybox", **kw)


async def test_the_next_create_of_a_shape_gets_a_fresh_warm_sandbox(
    plat: PlatformProcess, client: DSecClient
) -> None:
    before = await unexplained(plat, client)
    first = await client.run_container(args(labels={"who": "first"}, job_id="job-a"))
    await first.run_shell("echo secret > /root/left-behind; echo x > /dev/shm/x")
    (warm,) = await warm_ids(plat, client, before)
    hits = metric(plat, "dsec_warm_hits")
    second = await client.run_container(args(labels={"who": "second"}, env={}))
    try:
        assert second.id == warm  # the container started ahead, under the id it answers to
        assert metric(plat, "dsec_warm_hits") == hits + 1
        info = await second.refresh()
        assert info.labels == {"who": "second"} and info.spec.job_id is None
        r = await second.run_shell(
            "hostname; ls /root /dev/shm; cat /proc/1/cmdline | tr '\\0' ' '"
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split("\n")[0] == second.id
        assert "left-behind" not in r.stdout and "x" not in r.stdout.split()
        # the first sandbox is untouched by the second's start
        assert (await first.run_shell("cat /root/left-behind")).stdout == "secret\n"
        # its limits are the spec's (memory 64 MiB here)
        mem = await second.run_shell(
            "cat /sys/fs/cgroup/memory.max 2>/dev/null"
            " || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
        assert mem.stdout.strip() == str(64 << 20)
    finally:
        await second.stop()
        await first.stop()


async def test_another_shape_is_not_served_by_a_warm_sandbox(
    plat: PlatformProcess, client: DSecClient
) -> None:
    before = await unexplained(plat, client)
    sb = await client.run_container(args())
    await sb.stop()
    warm = await warm_ids(plat, client, before)
    for other in (args(memory_limit_mb=96), args(env={"A": "1"}), args(init_user="nobody")):
        hits = metric(plat, "dsec_warm_hits")
        made = await client.run_container(other)
        try:
            assert made.id not in warm
            assert metric(plat, "dsec_warm_hits") == hits
            env = await made.run_shell("echo $A; id -un")
            assert env.stdout.split() == ([*(["1"] if other.env else []), other.init_user])
        finally:
            await made.stop()


async def test_a_warm_sandbox_that_died_is_not_handed_out(
    plat: PlatformProcess, client: DSecClient
) -> None:
    before = await unexplained(plat, client)
    await (await client.run_container(args(pids_limit=77))).stop()
    (warm,) = await warm_ids(plat, client, before)
    pids = init_pids(plat, warm)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # one that exited since the listing
            os.kill(pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: the init has died once it is gone or a
    # zombie its parent has not reaped yet (dead all the same: dsec.linux.pid_alive)
    for _ in range(1000):  # 10 s at most
        if not any(linux.pid_alive(pid) for pid in pids):
            break
        await asyncio.sleep(0.01)
    sb = await client.run_container(args(pids_limit=77))
    try:
        assert sb.id != warm
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"
        assert (await sb.refresh()).state.value == "running"
    finally:
        await sb.stop()


async def test_a_moved_layer_tag_is_never_served_from_a_warm_sandbox(
    plat: PlatformProcess, client: DSecClient, tmp_path: Path
) -> None:
    src = tmp_path / "ws"
    src.mkdir()
    (src / "version").write_text("one\n")
    await client.build_layer("wp-ws:1", "dir", str(src), prefix="/ws")
    spec = args(workspace=LayerRef("wp-ws", "1"))
    before = await unexplained(plat, client)
    await (await client.run_container(spec)).stop()
    await warm_ids(plat, client, before)
    (src / "version").write_text("two\n")
    await client.build_layer("wp-ws:1", "dir", str(src), prefix="/ws")  # the tag moves
    sb = await client.run_container(spec)
    try:
        assert (await sb.run_shell("cat /ws/version")).stdout == "two\n"
    finally:
        await sb.stop()


async def test_nothing_is_left_when_the_platform_is_killed_with_warm_sandboxes() -> None:
    with platform_process(**KEEP_WARM) as p:
        c = DSecClient(p.url, p.api_key)
        await c.open()
        try:
            await c.build_image("busybox")
            await (await c.run_container(args())).stop()
            warm = await warm_ids(p, c)
        finally:
            await c.close()
        p.kill()
        p.start()  # the new edge's sweep removes what no record explains
        assert not any((p.data_dir / "sandboxes" / sid).exists() for sid in warm)
        assert not any(init_pids(p, sid) for sid in warm)
    # platform_process's leak check ran after the stop: nothing of the warm ones either


async def test_a_quota_refusal_gives_the_held_warm_sandbox_back(
    plat: PlatformProcess, client: DSecClient
) -> None:
    project = "wp-" + os.urandom(3).hex()
    await client.create_project(project)
    await client.set_quota(project, max_sandboxes=1)
    spec = args(project=project, cpu_cores_limit=0.5)
    before = await unexplained(plat, client)
    first = await client.run_container(spec)
    try:
        warm = await warm_ids(plat, client, before)
        with pytest.raises(DSecError) as refused:
            await client.run_container(spec)
        assert refused.value.status == 429
        assert warm <= await unexplained(plat, client)  # still there, still unused
    finally:
        await first.stop()
    hits = metric(plat, "dsec_warm_hits")
    again = await client.run_container(spec)
    try:
        assert again.id in warm and metric(plat, "dsec_warm_hits") == hits + 1
    finally:
        await again.stop()


async def test_a_create_failing_before_it_starts_frees_the_held_warm_sandbox(
    plat: PlatformProcess, client: DSecClient
) -> None:
    bb = await client.get_image("busybox")
    await client.compose_image("wp-gone:1", list(bb.layers))
    spec = DSecContainerRunArgs(container_image="wp-gone:1", memory_limit_mb=80)
    before = await unexplained(plat, client)
    await (await client.run_container(spec)).stop()
    (warm,) = await warm_ids(plat, client, before)
    await client.remove_image("wp-gone:1")
    with pytest.raises(DSecError) as gone:  # held for this create, which then found no image
        await client.run_container(spec)
    assert gone.value.status == 404
    await client.compose_image("wp-gone:1", list(bb.layers))  # the same image again
    hits = metric(plat, "dsec_warm_hits")
    again = await client.run_container(spec)
    try:
        assert again.id == warm and metric(plat, "dsec_warm_hits") == hits + 1
    finally:
        await again.stop()


async def test_a_warm_sandbox_from_before_a_component_restart_is_not_handed_out(
    plat: PlatformProcess, client: DSecClient
) -> None:
    """The seccomp listener's socket removed under the platform: the supervisor binds
    it again. A sandbox started before that restart may lack what one started after
    gets (its notify fd with the listener), so the next create starts its own."""
    before = await unexplained(plat, client)
    await (await client.run_container(args(pids_limit=91))).stop()
    (warm,) = await warm_ids(plat, client, before)
    warm_init = init_pids(plat, warm)
    assert warm_init
    sock = plat.data_dir / "run" / "seccomp.sock"
    ino = sock.stat().st_ino
    sock.unlink()
    deadline = time.monotonic() + 30
    while not (sock.exists() and sock.stat().st_ino != ino):
        assert time.monotonic() < deadline, "the seccomp socket was not bound again"
        await asyncio.sleep(0.05)
    hits = metric(plat, "dsec_warm_hits")
    sb = await client.run_container(args(pids_limit=91))
    try:
        # (the create may keep the id it was named with: a container of its own)
        assert metric(plat, "dsec_warm_hits") == hits
        assert init_pids(plat, sb.id).isdisjoint(warm_init)
        assert not any(linux.pid_alive(pid) for pid in warm_init)  # torn down, not kept
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"
    finally:
        await sb.stop()


async def test_dsec_up_keeps_warm_sandboxes_only_while_a_sandbox_lives() -> None:
    """On by default; once the edge's last live sandbox ended, the warm ones go after
    the grace (1 s here, 5 s by default): nothing started ahead is left on a host whose
    sandboxes were all stopped."""
    with platform_process(DSEC_WARM_GRACE_SECONDS="1") as p:
        async with DSecClient(p.url, p.api_key) as c:
            await c.build_image("busybox")
            keep = await c.run_container(args(memory_limit_mb=48))
            await (await c.run_container(args())).stop()
            await warm_ids(p, c, since={keep.id})
            await asyncio.sleep(2.5)  # past the grace: a sandbox lives, so they stay
            # (read now: the stopped sandbox's own directory is gone by then)
            warm = await unexplained(p, c)
            assert warm and metric(p, "dsec_warm_sandboxes") >= 1
            pids = {pid for sid in warm for pid in init_pids(p, sid)}
            assert pids
            await keep.stop()
            deadline = time.monotonic() + 30
            while await unexplained(p, c) or metric(p, "dsec_warm_sandboxes"):
                assert time.monotonic() < deadline, "warm sandboxes outlived the last sandbox"
                await asyncio.sleep(0.1)
            assert not any(linux.pid_alive(pid) for pid in pids)
            assert not any(init_pids(p, sid) for sid in warm)
