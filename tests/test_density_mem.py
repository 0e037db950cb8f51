"""Issue 19, items 2 and 3: admission by use, memory that is really reclaimed.

The arithmetic of admission (capacity from /proc, typed refusals by resource) is tested
on fixed inputs; swap, reclaim and prefetch on real cgroups, a real swap file behind a
real loop device and real sandboxes."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.api.spec import DSecContainerRunArgs as Spec
from dsec.edge.admission import Admission, HostUse
from dsec.errors import AdmissionRejected
from dsec.resources import capacity, cgroups, swap
from dsec.resources.capacity import Pressure, SandboxCost
from tests.conftest import PlatformProcess, platform_process
from tests.hostprint import operator_swap_areas
from tests.waiting import until

MiB = 1 << 20
GiB = 1 << 30


def _fake_proc(tmp_path: Path, *, mem_total_kb: int, some10: float = 0.0) -> Path:
    proc = tmp_path / "proc"
    (proc / "sys/kernel").mkdir(parents=True)
    (proc / "sys/fs").mkdir(parents=True)
    (proc / "pressure").mkdir()
    (proc / "meminfo").write_text(
        f"MemTotal:       {mem_total_kb} kB\nMemAvailable:   {mem_total_kb // 2} kB\n"
    )
    (proc / "sys/kernel/pid_max").write_text("4194304\n")
    (proc / "sys/kernel/threads-max").write_text("191000\n")
    (proc / "sys/fs/file-max").write_text("9223372036854775807\n")
    (proc / "pressure/memory").write_text(
        f"some avg10={some10:.2f} avg60=1.50 avg300=0.00 total=1\n"
        "full avg10=0.50 avg60=0.00 avg300=0.00 total=1\n"
    )
    return proc


def test_capacity_is_the_smallest_host_table(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, mem_total_kb=24 * 1024 * 1024, some10=12.5)
    cost = SandboxCost(
        host_memory_bytes=704 * 1024, tasks=8, files=64, edge_fds=4, shrinker_slot_bytes=16
    )
    cap = capacity.host_capacity(cost, memory_reserve_bytes=GiB, proc=proc, nofile=20_000)
    # memory: the most whose cost fits 23 GiB (shrinker maps included: 13,556, not the
    # 34,257 of 704 KiB each); threads 191,000 * 0.9 / 8 = 21,487; edge fds 4,744
    assert cap.limits["memory"] == cost.most_that_fit(23 * GiB) == 13_556
    assert cap.limits["threads"] == 191_000 * 9 // 10 // 8
    assert cap.limits["edge_fds"] == (20_000 - 1024) // 4
    assert (cap.by, cap.max_sandboxes) == ("edge_fds", cap.limits["edge_fds"])
    cap = capacity.host_capacity(cost, memory_reserve_bytes=GiB, proc=proc, nofile=1 << 20)
    assert cap.by == "memory"
    # The edge holds one fd per idle container (its notify fd, dsec...initwatch).
    assert SandboxCost().edge_fds == 1
    cap = capacity.host_capacity(SandboxCost(), memory_reserve_bytes=GiB, proc=proc, nofile=20_000)
    assert cap.limits["edge_fds"] == 20_000 - 1024
    psi = capacity.read_pressure("memory", proc)
    assert psi == Pressure(12.5, 1.5, 0.5)
    assert capacity.read_pressure("memory", tmp_path / "nowhere") is None
    assert capacity.meminfo(proc)["MemTotal"] == 24 * GiB


def test_the_memory_of_n_sandboxes_counts_their_shrinker_maps() -> None:
    """Every memory cgroup has a slot for every superblock on the host, 5 per sandbox:
    the memory of N sandboxes grows with N squared, and the count limit is the exact
    largest N that fits, never the constant-cost figure."""
    cost = SandboxCost(host_memory_bytes=704 * 1024, superblocks=5, shrinker_slot_bytes=16)
    slots = capacity.HOST_SHRINKER_IDS + 5 * 10_000
    assert cost.memory_of(10_000) == 10_000 * (704 * 1024 + 16 * slots)
    assert cost.memory_of(0) == 0
    # the next sandbox: its own part, its map, and 5 more slots in each other's map
    assert cost.one_more(0) == 704 * 1024 + 16 * (capacity.HOST_SHRINKER_IDS + 5)
    assert cost.one_more(10_000) == cost.memory_of(10_001) - cost.memory_of(10_000)
    assert cost.one_more(10_000) > 2 * MiB > cost.one_more(0)
    for budget in (0, 1, 704 * 1024, 23 * GiB, 23 * GiB + 12_345, 510 * GiB, 4 << 40):
        n = cost.most_that_fit(budget)
        assert cost.memory_of(n) <= budget < cost.memory_of(n + 1), budget
    # a 512 GiB host: ~78,000, where a constant 1.5 MiB each promised 348,160
    assert 77_000 < cost.most_that_fit(510 * GiB) < 79_000
    # no per-memcg map (before Linux 4.19): the constant-cost figure
    flat = SandboxCost(host_memory_bytes=704 * 1024, shrinker_slot_bytes=0)
    assert flat.most_that_fit(23 * GiB) == 23 * GiB // (704 * 1024)


def test_a_shrinker_slot_costs_what_the_kernel_allocates(tmp_path: Path) -> None:
    nowhere = tmp_path / "sys"
    assert capacity.shrinker_slot_bytes("6.18.0-pvm", nowhere) == 16  # 520 B per 64 ids
    assert capacity.shrinker_slot_bytes("6.7.1", nowhere) == 16
    assert capacity.shrinker_slot_bytes("6.6.58-generic", nowhere) == 8  # bit + long
    assert capacity.shrinker_slot_bytes("4.19.0", nowhere) == 8
    assert capacity.shrinker_slot_bytes("4.18.20", nowhere) == 0  # no per-memcg map
    assert capacity.shrinker_slot_bytes("garbage", nowhere) == 16  # the costlier layout
    node = tmp_path / "sys/devices/system/node"
    node.mkdir(parents=True)
    (node / "online").write_text("0-1,3\n")  # one map per NUMA node: 3 nodes
    assert capacity.shrinker_slot_bytes("6.18.0", tmp_path / "sys") == 48
    assert SandboxCost().shrinker_slot_bytes == capacity.shrinker_slot_bytes()


def _spec(mb: int = 64, cpu: float = 1.0) -> Spec:
    return Spec(container_image="busybox:latest", memory_limit_mb=mb, cpu_cores_limit=cpu)


def test_one_host_reading_decides_a_create() -> None:
    """measure() once: shortfall and admit decide on the same reading (the create path
    reads /proc once), and a refusal still comes from what that reading says."""
    a = Admission(max_sandboxes=None)
    reads: list[str] = []

    def available() -> int:
        reads.append("mem")
        return 64 * GiB

    def pressure() -> Pressure:
        reads.append("psi")
        return Pressure(0.0, 0.0, 0.0)

    a.read_available = available
    a.read_pressure = pressure
    use = a.measure()
    assert use is not None and a.shortfall(use) == 0
    a.admit(_spec(), use)
    assert reads == ["mem", "psi"]  # one of each, not two
    with pytest.raises(AdmissionRejected) as err:
        a.admit(_spec(), HostUse(a.reserve_bytes, None))
    assert err.value.details["resource"] == "memory_available"
    with pytest.raises(AdmissionRejected) as err:
        a.admit(_spec(), HostUse(64 * GiB, Pressure(90.0, 0.0, 0.0)))
    assert err.value.details["resource"] == "memory_pressure"
    assert Admission(max_sandboxes=5, measure_use=False).measure() is None


def test_mem_available_reads_the_one_line(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, mem_total_kb=8 * 1024 * 1024)
    assert capacity.mem_available(proc) == 4 * GiB
    assert capacity.mem_available(proc) == capacity.meminfo(proc)["MemAvailable"]
    (proc / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 5 kB\n")
    assert capacity.mem_available(proc) == 0  # no such line
    (proc / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable: lots kB\n")
    assert capacity.mem_available(proc) == 0  # garbage
    assert capacity.mem_available(tmp_path / "nowhere") == 0


def test_admission_by_use_refuses_naming_the_resource() -> None:
    a = Admission(max_sandboxes=None, cpu_overcommit=0.0)
    assert a.capacity.by != "setting" and a.max_sandboxes > 1000  # derived, not 2,000
    # default 32x: 10,000 idle 64 MiB sandboxes fit a 24 GiB host's commitments
    assert a.memory_budget_mb == a.host_memory_mb * 32
    avail = [64 * GiB]
    a.read_available = lambda: avail[0]
    a.read_pressure = lambda: Pressure(0.0, 0.0, 0.0)
    for _ in range(50):  # CPU is not admitted by: 50 one-core sandboxes on any host
        a.admit(_spec(cpu=1.0))
    assert a.shortfall() == 0
    avail[0] = a.reserve_bytes  # less than reserve + one sandbox's cost
    assert a.shortfall() == a.cost.one_more(50)
    with pytest.raises(AdmissionRejected) as err:
        a.admit(_spec())
    assert err.value.details["resource"] == "memory_available"
    assert err.value.status == 503
    avail[0] = 64 * GiB
    a.read_pressure = lambda: Pressure(75.0, 40.0, 10.0)
    assert a.shortfall() >= 64 * MiB
    with pytest.raises(AdmissionRejected, match="pressure") as err:
        a.admit(_spec())
    assert err.value.details["resource"] == "memory_pressure"
    report = a.report()
    assert report["admitted"] == 50 and report["memory_pressure_some_avg10"] == 75.0
    assert f"capacity_by_{a.capacity.by}" in report

    cpu = Admission(max_sandboxes=3, cpu_overcommit=1.0, measure_use=False)
    for _ in range(cpu.host_cpus):
        cpu.admit(_spec(cpu=1.0))
    with pytest.raises(AdmissionRejected) as err:
        cpu.admit(_spec(cpu=1.0))
    assert err.value.details["resource"] in ("cpu", "sandboxes")
    full = Admission(max_sandboxes=1, measure_use=False)
    full.admit(_spec())
    with pytest.raises(AdmissionRejected, match="full") as err:
        full.admit(_spec())
    assert err.value.details["resource"] == "sandboxes"
    assert err.value.details["limited_by"] == "setting"


# -- real swap, reclaim and prefetch ---------------------------------------------------
def _mem(edge_id: str, sandbox_id: str) -> Path:
    return cgroups.detect().v1["memory"] / "dsec" / edge_id / sandbox_id


def _mstat(edge_id: str, sandbox_id: str) -> dict[str, int]:
    text = (_mem(edge_id, sandbox_id) / "memory.stat").read_text()
    return {k: int(v) for k, v in (line.split() for line in text.splitlines())}


def _usage(edge_id: str, sandbox_id: str) -> int:
    return int((_mem(edge_id, sandbox_id) / "memory.usage_in_bytes").read_text())


# A process holding 48 MiB of anonymous heap, in the background (busybox awk). The
# command returns at once; the heap is there only once awk has built its string (over
# 0.5 s on a loaded host): wait for it with held_48m.
HOLD_48M = '(awk \'BEGIN{s=sprintf("%50331648s","x"); system("sleep 100000")}\' >/dev/null 2>&1 &)'


def held_48m(edge_id: str, sandbox_id: str) -> None:
    until(
        "the sandbox holds 48 MiB of anonymous memory",
        lambda: _mstat(edge_id, sandbox_id)["total_rss"] >= 48 * MiB,
        30,
    )


v1_memory = pytest.mark.skipif("memory" not in cgroups.detect().v1, reason="v1 memory controller")


@pytest.mark.root
@v1_memory
async def test_pause_swaps_out_by_default_and_resume_prefetches(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    # The platform turned on a swap file of its own below its data dir (no setting).
    (area,) = [
        s for s in swap.active_swaps() if swap.area_file(s).startswith(str(platform.data_dir))
    ]
    assert swap.loop_backing_file(area.filename) is not None  # through a loop device
    job = "job-" + secrets.token_hex(4)
    sb = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=128, job_id=job)
    )
    try:
        r = await sb.run_shell(HOLD_48M)
        assert r.exit_code == 0, r.stderr
        held_48m(platform.edge_id, sb.id)
        report = await client.pause_job(job)
        assert report.paused == 1 and report.swap_available, report
        (p,) = report.sandboxes
        assert p.anon_bytes is not None and p.anon_bytes < 8 * MiB, p
        assert (p.swap_bytes or 0) >= 40 * MiB, p
        low = _usage(platform.edge_id, sb.id)

        resumed = await client.resume_job(job)
        assert resumed.resumed == 1
        # done within the answer's wait, or still going on behind it (a loaded disk)
        assert resumed.prefetched_bytes >= 48 * MiB or resumed.prefetch_pending, resumed
        # Read back without any command run in the sandbox: the prefetch did it.
        deadline = time.monotonic() + 20
        while _usage(platform.edge_id, sb.id) < low + 32 * MiB:
            assert time.monotonic() < deadline, (low, _usage(platform.edge_id, sb.id))
            await asyncio.sleep(0.05)
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"
        assert (await sb.refresh()).state is SandboxState.RUNNING
    finally:
        await sb.stop()


@pytest.mark.root
@v1_memory
async def test_idle_sandbox_gives_back_its_page_cache() -> None:
    """DSEC_IDLE_RECLAIM_SECONDS=1: a sandbox left alone loses its page cache, keeps
    running and keeps its files; health reports admission's capacity and pressure."""
    with platform_process(DSEC_IDLE_RECLAIM_SECONDS="1") as plat:
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            health = await client.health()
            assert health.admission["capacity"] == health.capacity > 1000
            assert health.admission["capacity_limited_by"] in (
                "memory",
                "pids",
                "threads",
                "files",
                "edge_fds",
            )
            assert "memory_available_mb" not in health.admission  # not for anyone to see
            await client.build_image("busybox")
            sb = await client.run_container(
                DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=128)
            )
            r = await sb.run_shell(
                "dd if=/dev/urandom of=/root/data bs=1M count=24 2>/dev/null && "
                "md5sum /root/data | cut -c1-32"
            )
            digest = r.stdout
            cached = _mstat(plat.edge_id, sb.id)["total_cache"]
            assert cached >= 20 * MiB
            deadline = time.monotonic() + 10
            while _mstat(plat.edge_id, sb.id)["total_cache"] > cached - 16 * MiB:
                assert time.monotonic() < deadline, "idle page cache was not reclaimed"
                await asyncio.sleep(0.2)
            assert (await sb.refresh()).state is SandboxState.RUNNING
            assert (await sb.run_shell("md5sum /root/data | cut -c1-32")).stdout == digest
            await sb.stop()
        finally:
            await client.close()


@pytest.mark.root
def test_platform_swap_file_is_adopted_after_a_crash_and_removed(tmp_path: Path) -> None:
    before = operator_swap_areas()
    path = tmp_path / "swap" / "adopt.swap"
    first = swap.SwapFile(path, 64 * MiB, loop=True, managed=True)
    try:
        first.enable()
        assert first.activated and path.exists()
        # a new process on the same data dir (the first one "crashed"): adopts it
        again = swap.SwapFile(path, 64 * MiB, loop=True, managed=True)
        again.enable()
        assert again.activated and again.device == first.device
        again.remove()
        assert not path.exists()
        assert not any(swap.area_file(s) == str(path) for s in swap.active_swaps())
    finally:
        swap.remove_areas_below(tmp_path)
    assert operator_swap_areas() == before


@pytest.mark.root
async def test_refusal_under_memory_pressure_is_typed_over_http() -> None:
    """DSEC_ADMISSION_PRESSURE=0: the host always counts as under memory pressure, so
    after the idle reclaimer found nothing to give back, a create is refused with a
    503 that names the resource (no sandbox is left behind)."""
    with platform_process(DSEC_ADMISSION_PRESSURE="0") as plat:
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            await client.build_image("busybox")
            with pytest.raises(AdmissionRejected, match="pressure") as err:
                await client.run_container(DSecContainerRunArgs(container_image="busybox:latest"))
            assert err.value.details["resource"] == "memory_pressure"
            assert await client.list_sandboxes() == []
        finally:
            await client.close()


def test_v2_idle_reclaim_asks_for_the_cold_bytes_only(tmp_path: Path) -> None:
    """The v2 path, on a directory laid out as a v2 cgroup (this host's memory
    controller is on v1): memory.reclaim is asked for the inactive bytes, with
    swappiness=0 unless anonymous memory may go; nothing below 256 KiB of cache."""
    from dsec.resources import reclaim
    from dsec.resources.cgroups import CgroupHost, Layout

    host = CgroupHost(Layout.V2, {}, tmp_path)
    cg = tmp_path / "dsec" / "e" / "sb"
    cg.mkdir(parents=True)
    (cg / "memory.current").write_text(str(90 * MiB))
    (cg / "memory.stat").write_text(
        f"anon {20 * MiB}\nfile {70 * MiB}\nshmem 0\n"
        f"inactive_anon {12 * MiB}\nactive_anon {8 * MiB}\n"
        f"inactive_file {60 * MiB}\nactive_file {10 * MiB}\n"
    )
    (cg / "memory.reclaim").write_text("")
    assert reclaim.reclaim_idle(host, "/dsec/e/sb", anon=False) == (90 * MiB, 90 * MiB)
    assert (cg / "memory.reclaim").read_text() == f"{60 * MiB} swappiness=0"
    reclaim.reclaim_idle(host, "/dsec/e/sb", anon=True)
    assert (cg / "memory.reclaim").read_text() == f"{72 * MiB} swappiness=100"
    (cg / "memory.stat").write_text("anon 1\nfile 4096\nshmem 0\ninactive_file 4096\n")
    (cg / "memory.reclaim").write_text("")
    reclaim.reclaim_idle(host, "/dsec/e/sb", anon=False)
    assert (cg / "memory.reclaim").read_text() == ""  # too little to be worth it
