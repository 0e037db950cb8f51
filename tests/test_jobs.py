"""Job-level pause and resume (DSEC.md §6.3) on a real platform: real cgroup freezer,
real reclaim, a real SIGKILL of the platform. Nothing here is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.errors import InvalidArgument
from dsec.resources import cgroups, swap
from dsec.security import protected
from tests.conftest import PlatformProcess, platform_process
from tests.hostprint import operator_swap_areas

pytestmark = pytest.mark.root

MiB = 1024 * 1024


def _job() -> str:
    return "job-" + secrets.token_hex(4)


def _frozen(edge_id: str, sandbox_id: str) -> bool:
    return protected.is_frozen(cgroups.detect(), f"/dsec/{edge_id}/{sandbox_id}")


def _edge(sandbox_id: str) -> str:
    return sandbox_id.rsplit("-", 1)[0]


async def test_pause_reclaims_and_next_request_thaws(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    job = _job()
    spec = DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=128, job_id=job)
    a = await client.run_container(spec)
    b = await client.run_container(spec)
    other = await client.run_container(spec.model_copy(update={"job_id": job + "-x"}))
    proxy = DSecClient(platform.url, platform.api_key, data_path="proxy")
    await proxy.open()
    try:
        for sb in (a, b):
            # page cache (a file in the upper) and anonymous memory (tmpfs /dev/shm)
            r = await sb.run_shell(
                "dd if=/dev/urandom of=/root/data bs=1M count=16 2>/dev/null && "
                "dd if=/dev/zero of=/dev/shm/anon bs=1M count=8 2>/dev/null && "
                "md5sum /root/data | cut -c1-32"
            )
            assert r.exit_code == 0, r.stderr
        digest = (await a.run_shell("md5sum /root/data | cut -c1-32")).stdout

        report = await client.pause_job(job)
        assert report.paused == 2 and report.failed == 0
        assert {p.sandbox_id for p in report.sandboxes} == {a.id, b.id}
        assert report.memory_reclaimed_bytes >= 16 * MiB, report  # the file's page cache
        assert all(p.duration < 5 for p in report.sandboxes)
        for sb in (a, b):
            assert (await sb.refresh()).state is SandboxState.PAUSED
            assert _frozen(_edge(sb.id), sb.id)
        assert (await other.refresh()).state is SandboxState.RUNNING
        assert not _frozen(_edge(other.id), other.id)
        # listed as live, and a second pause is a no-op
        live = {s.id for s in await client.list_sandboxes()}
        assert {a.id, b.id} <= live
        again = await client.pause_job(job)
        assert again.paused == 0 and again.already_paused == 2

        # The next request thaws transparently: edge data path (a) and API proxy (b).
        r = await a.run_shell("md5sum /root/data | cut -c1-32; wc -c < /dev/shm/anon")
        assert r.stdout == digest + str(8 * MiB) + "\n"
        assert (await a.refresh()).state is SandboxState.RUNNING
        assert not _frozen(_edge(a.id), a.id)
        pb = await proxy.get(b.id)
        assert (await pb.read_file("/dev/shm/anon"))[:4] == b"\0\0\0\0"
        assert (await b.refresh()).state is SandboxState.RUNNING

        # resume_job thaws what is still paused, and only that.
        await client.pause_job(job)
        rep = await client.resume_job(job)
        assert rep.resumed == 2 and set(rep.sandbox_ids) == {a.id, b.id}
        for sb in (a, b):
            assert (await sb.refresh()).state is SandboxState.RUNNING
            assert not _frozen(_edge(sb.id), sb.id)
        assert (await client.resume_job(job)).resumed == 0

        # A paused sandbox stops cleanly (frozen tasks must be thawed to die).
        await client.pause_job(job)
        assert (await a.stop()).state is SandboxState.STOPPED
    finally:
        await proxy.close()
        for sb in (a, b, other):
            with contextlib.suppress(Exception):
                await sb.stop()


async def test_ttl_does_not_fire_while_paused(client: DSecClient, busybox_image: str) -> None:
    job = _job()
    sb = await client.run_container(
        DSecContainerRunArgs(
            container_image=busybox_image, memory_limit_mb=64, job_id=job, ttl_running_stop=2
        )
    )
    try:
        assert (await client.pause_job(job)).paused == 1
        await asyncio.sleep(4.5)  # > ttl + reaper interval
        assert (await sb.refresh()).state is SandboxState.PAUSED
        assert (await client.resume_job(job)).resumed == 1
        # the idle clock restarted at the resume: the TTL still works afterwards
        await asyncio.sleep(1.0)
        info = await sb.refresh()
        assert info.state is SandboxState.RUNNING, info.reason
        for _ in range(60):
            if (await sb.refresh()).state.terminal:
                break
            await asyncio.sleep(0.2)
        assert sb.state is SandboxState.STOPPED and "ttl_running_stop" in (sb.info.reason or "")
    finally:
        await sb.stop()


async def test_bad_job_ids_are_4xx(client: DSecClient, platform: PlatformProcess) -> None:
    for bad in ("a/b", "bad job", "-x", ""):
        with pytest.raises(InvalidArgument):
            await client.pause_job(bad)
    with pytest.raises(ValidationError):  # the spec takes the same job ids
        DSecContainerRunArgs(container_image="busybox:latest", job_id="bad job")
    assert (await client.pause_job("no-such-job-" + secrets.token_hex(3))).paused == 0
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            f"{platform.url}/v1/jobs/{'x' * 200}/pause",
            headers={"Authorization": f"Bearer {platform.api_key}"},
        )
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_argument"


async def test_pause_survives_platform_restart() -> None:
    job = _job()
    with platform_process() as plat:
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=64, job_id=job
            )
            sb = await client.run_container(spec)
            left = await client.run_container(spec)
            await sb.run_shell("echo kept > /dev/shm/mem; echo disk > /root/f")
            assert (await client.pause_job(job)).paused == 2
        finally:
            await client.close()
        plat.kill()  # SIGKILL: no chance to thaw or record anything more
        assert _frozen(plat.edge_id, sb.id), "the kernel keeps the freeze"
        plat.start()
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            again = await client.get(sb.id)
            assert again.state is SandboxState.PAUSED
            assert _frozen(plat.edge_id, sb.id)
            r = await again.run_shell("cat /dev/shm/mem /root/f")  # thaws it
            assert r.stdout == "kept\ndisk\n"  # same container: memory state kept
            assert (await again.refresh()).state is SandboxState.RUNNING
            # `left` stays paused; the platform's shutdown must still tear it down
            assert (await client.get(left.id)).state is SandboxState.PAUSED
        finally:
            await client.close()


@contextlib.contextmanager
def _scratch_swap_dir() -> Iterator[Path]:
    """A directory for a test swap file: whatever happens in the test, the file is
    turned off and removed, and the host's swap is exactly what it was before."""
    before = operator_swap_areas()
    base = Path(tempfile.mkdtemp(prefix="dsec-test-swap-", dir="/tmp"))
    try:
        yield base
    finally:
        for area in swap.active_swaps():
            if Path(swap.area_file(area)).parent == base:  # the file, or its loop device
                swap.SwapFile(Path(area.filename), 0, activated=True).disable()
        shutil.rmtree(base, ignore_errors=True)
        assert operator_swap_areas() == before, "the host's swap changed"


def _mstat(edge_id: str, sandbox_id: str) -> dict[str, int]:
    path = cgroups.detect().v1["memory"] / "dsec" / edge_id / sandbox_id / "memory.stat"
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def _cg_file(edge_id: str, sandbox_id: str, name: str) -> str:
    return (cgroups.detect().v1["memory"] / "dsec" / edge_id / sandbox_id / name).read_text()


@pytest.mark.skipif("memory" not in cgroups.detect().v1, reason="v1 memory controller")
async def test_pause_pushes_anon_memory_to_a_configured_swap_file() -> None:
    with _scratch_swap_dir() as base:
        swap_file = base / "swap"
        with platform_process(DSEC_SWAP_FILE=str(swap_file), DSEC_SWAP_GB="1") as plat:
            # on through a loop device of its own: direct I/O, SSD mode (module doc)
            (area,) = [s for s in swap.active_swaps() if swap.area_file(s) == str(swap_file)]
            loop = Path("/sys/block") / Path(area.filename).name
            assert (loop / "loop" / "dio").read_text().strip() == "1"
            assert (loop / "queue" / "rotational").read_text().strip() == "0"
            assert swap_file.stat().st_mode & 0o777 == 0o600
            client = DSecClient(plat.url, plat.api_key)
            await client.open()
            try:
                await client.build_image("busybox")
                job = _job()
                sb = await client.run_container(
                    DSecContainerRunArgs(
                        container_image="busybox:latest", memory_limit_mb=256, job_id=job
                    )
                )
                # 64 MiB of incompressible data in tmpfs (anonymous: shmem)
                r = await sb.run_shell(
                    "dd if=/dev/urandom of=/dev/shm/data bs=1M count=64 2>/dev/null && "
                    "md5sum /dev/shm/data | cut -c1-32",
                    timeout=60,
                )
                assert r.exit_code == 0, r.stderr
                digest = r.stdout
                limit = _cg_file(plat.edge_id, sb.id, "memory.limit_in_bytes")
                # a running sandbox stays off swap: at its limit it is OOM-killed as before
                assert _cg_file(plat.edge_id, sb.id, "memory.swappiness").strip() == "0"
                before = _mstat(plat.edge_id, sb.id)
                anon0 = before["total_rss"] + before["total_shmem"]
                assert anon0 >= 64 * MiB

                report = await client.pause_job(job)
                assert report.paused == 1 and report.swap_available, report
                after = _mstat(plat.edge_id, sb.id)
                anon1 = after["total_rss"] + after["total_shmem"]
                assert anon1 <= anon0 // 10, (anon0, anon1)  # >= 90% left RAM
                assert after["total_swap"] >= 64 * MiB * 9 // 10
                (p,) = report.sandboxes
                assert p.anon_before_bytes and p.anon_bytes is not None
                assert p.anon_bytes <= p.anon_before_bytes // 10, p
                assert (p.swap_bytes or 0) >= 64 * MiB * 9 // 10, p
                assert (report.anon_returned_fraction or 0) >= 0.9, report
                assert report.memory_reclaimed_bytes >= 64 * MiB * 9 // 10
                # nothing of the sandbox's limits or swap policy changed
                assert _cg_file(plat.edge_id, sb.id, "memory.limit_in_bytes") == limit
                assert _cg_file(plat.edge_id, sb.id, "memory.swappiness").strip() == "0"

                rep = await client.resume_job(job)
                assert rep.resumed == 1
                r = await sb.run_shell("md5sum /dev/shm/data | cut -c1-32", timeout=60)
                assert r.stdout == digest, "data changed across swap-out and back"
                assert "oom_kill 0" in _cg_file(plat.edge_id, sb.id, "memory.oom_control")
                assert (await sb.refresh()).state is SandboxState.RUNNING
                await sb.stop()
            finally:
                await client.close()
        # the platform's clean shutdown turned off the swap it turned on, and the loop
        # device went with it (autoclear)
        assert not any(swap.area_file(s) == str(swap_file) for s in swap.active_swaps())
        deadline = time.monotonic() + 5  # autoclear detaches at the last close (udev's too)
        while swap.loop_backing_file(area.filename) == str(swap_file):
            assert time.monotonic() < deadline, "the loop device outlived its swap area"
            await asyncio.sleep(0.05)
        assert swap_file.exists()  # kept for the next start


@pytest.mark.skipif("memory" not in cgroups.detect().v1, reason="v1 memory controller")
def test_swap_file_without_loop_device_is_turned_on_as_a_file() -> None:
    """DSEC_SWAP_LOOP=0 (or no loop support): the file itself, as before."""
    with _scratch_swap_dir() as base:
        f = swap.SwapFile(base / "swap", 1 << 30, loop=False)
        f.enable()
        try:
            assert f.activated and f.device is None
            assert any(s.filename == str(base / "swap") for s in swap.active_swaps())
        finally:
            f.remove()
        assert not (base / "swap").exists()


async def test_swap_file_never_in_a_sandbox_path_nor_touching_operator_swap(
    tmp_path: Path,
) -> None:
    cfg_dir = tmp_path / "d"
    f = swap.SwapFile(cfg_dir / "sandboxes" / "x" / "swap", 1 << 30)
    with pytest.raises(swap.SwapError, match="sandbox-visible"):
        f.check_location([cfg_dir / "sandboxes"])
    with pytest.raises(swap.SwapError, match="absolute"):
        swap.SwapFile(Path("rel/swap"), 1 << 30).check_location([])
    # an existing file without a swap header is never mkswap'ed nor turned on
    junk = tmp_path / "junk"
    junk.write_bytes(b"precious" * 1024)
    os.chmod(junk, 0o600)
    with pytest.raises(swap.SwapError, match="not a swap file"):
        swap.SwapFile(junk, 1 << 30).enable()
    assert junk.read_bytes() == b"precious" * 1024
