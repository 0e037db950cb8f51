"""Job pause/resume, pack_diff and fork (issue 6, DSEC.md §6.1 and §6.3), in one run.

    .venv/bin/python bench/bench_rl.py [--n 100] [--mib 64] [--creates 30] [--swap-gb 8]
        [--modes loop,file] [--skip-no-swap] [--no-4k]

On a real platform (`dsec up` in a subprocess, fresh data dir): ``n`` sandboxes of one
job each hold ``mib`` MiB (at most 64: the sandbox's /dev/shm size) of anonymous memory
(a tmpfs file of random data written 1 MiB at a time: shmem, which only swap can take
out of RAM); pause_job, then resume_job and the first touch of the held data (reading
it back in, minus a second, warm read), then a pause followed by transparent thaws (the
next exec). Host MemAvailable is read before and after each step, so "memory returned
to the host" is what the host saw, not what we asked for; the host's CPU split and the
kernel's swap-out counters during the pause say where the time went.

Runs, side by side: without swap (plus pack_diff/fork); with a swap file of
``--swap-gb`` GiB that the platform turns on through a loop device (``loop``, the
default: DSEC_SWAP_FILE, dsec.resources.swap), where an extra row holds the same random
data written 4 KiB at a time (``random-4k``: 4 KiB pages, the worst case: no large
folios); and the same file turned on directly (``file``: DSEC_SWAP_LOOP=0, the previous
design, as the baseline). Each swap file is removed afterwards. Then pack_diff of a
sandbox with 100 MiB of changes, creates from the packed layer vs from the base image,
fork(16). Writes bench/results/rl.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs, Sandbox  # noqa: E402
from dsec.resources import cgroups  # noqa: E402
from dsec.resources import swap as swapmod  # noqa: E402
from dsec.resources.reclaim import swap_available  # noqa: E402

MiB = 1024 * 1024


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "n": len(s),
        "p50_ms": round(statistics.median(s) * 1e3, 3),
        "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 3),
    }


def loadavg() -> list[str]:
    """1, 5 and 15 minute load: other work on the host makes the figures noisy."""
    return Path("/proc/loadavg").read_text().split()[:3]


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, val = line.partition(" ")
        out[key] = int(val)
    return out


def large_folio_swpout() -> dict[str, int]:
    """Pages swapped out inside large (multi-page) folios, and large folios that had to
    be split first (per-size mTHP counters; thp_swpout counts only 2 MiB ones)."""
    out = {"pages": 0, "fallback_folios": 0}
    for d in Path("/sys/kernel/mm/transparent_hugepage").glob("hugepages-*kB"):
        pages = int(d.name.removeprefix("hugepages-").removesuffix("kB")) // 4
        with contextlib.suppress(OSError, ValueError):
            out["pages"] += pages * int((d / "stats" / "swpout").read_text())
            out["fallback_folios"] += int((d / "stats" / "swpout_fallback").read_text())
    return out


def cpu_ticks() -> list[int]:
    """/proc/stat's all-CPU line: user nice system idle iowait irq softirq steal."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def cpu_split(d: list[int]) -> tuple[int, int, int, int]:
    """user+nice, system+irq+softirq, iowait, idle+steal."""
    return d[0] + d[1], d[2] + d[5] + d[6], d[4], d[3] + d[7]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def zram_swap(mib: int) -> Iterator[str | None]:
    """A temporary zram swap device (compressed RAM), removed afterwards; None if 0."""
    if mib <= 0:
        yield None
        return
    idx = int(Path("/sys/class/zram-control/hot_add").read_text())
    dev, block = f"/dev/zram{idx}", Path(f"/sys/block/zram{idx}")
    on = False
    try:
        with contextlib.suppress(OSError):
            (block / "comp_algorithm").write_text("lz4")
        (block / "disksize").write_text(str(mib * MiB))
        subprocess.run(["mkswap", dev], check=True, capture_output=True)
        subprocess.run(["swapon", "-p", "100", dev], check=True)
        on = True
        yield dev
    finally:
        if on:
            subprocess.run(["swapoff", dev], check=False)
        with contextlib.suppress(OSError):
            (block / "reset").write_text("1")
        with contextlib.suppress(OSError):
            Path("/sys/class/zram-control/hot_remove").write_text(str(idx))


async def pause_resume(
    client: DSecClient, image: str, n: int, mib: int, fill: str
) -> dict[str, object]:
    job = "bench-job"
    spec = DSecContainerRunArgs(
        container_image=image, memory_limit_mb=mib * 2 + 64, job_id=job, ttl_running_stop=None
    )
    sbs = []
    for _ in range(n):
        sbs.append(await client.run_container(spec))
    # A tmpfs file: anonymous memory (shmem) that a later exec can read back, so the
    # first touch after a resume is measurable from inside the sandbox.
    src = "/dev/zero" if fill == "zero" else "/dev/urandom"
    if fill == "random-4k":  # written 4 KiB at a time: 4 KiB pages, no large folios
        hold = f"dd if={src} of=/dev/shm/hold bs=4k count={mib * 256} 2>/dev/null"
    else:
        hold = f"dd if={src} of=/dev/shm/hold bs=1M count={mib} 2>/dev/null"
    sem = asyncio.Semaphore(4)

    async def fill_one(sb: Sandbox) -> None:
        async with sem:
            r = await sb.run_shell(hold, timeout=300)
            assert r.exit_code == 0, r.stderr

    await asyncio.gather(*(fill_one(sb) for sb in sbs))
    # wait until every buffer is filled (random data takes a while on 2 cores)
    host = cgroups.detect()
    edge = sbs[0].id.rsplit("-", 1)[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        used = [host.memory_usage(f"/dsec/{edge}/{sb.id}") or 0 for sb in sbs]
        if min(used) >= mib * MiB:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2)
    avail0 = mem_available()
    load = loadavg()
    vm0, cpu0, lf0 = vmstat(), cpu_ticks(), large_folio_swpout()
    t = time.perf_counter()
    rep = await client.pause_job(job)
    pause_wall = time.perf_counter() - t
    vm1, cpu1, lf1 = vmstat(), cpu_ticks(), large_folio_swpout()
    await asyncio.sleep(0.5)
    avail1 = mem_available()
    t = time.perf_counter()
    res = await client.resume_job(job)
    resume_wall = time.perf_counter() - t
    # first touch: read the held data back (swap-in where it was swapped out), then the
    # same read again (warm); the difference is what the swap-out costs the sandbox.
    first, again = [], []
    for sb in sbs[:30]:
        t = time.perf_counter()
        await sb.run_shell("cat /dev/shm/hold >/dev/null")
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.run_shell("cat /dev/shm/hold >/dev/null")
        again.append(time.perf_counter() - t)
    # transparent thaw: the first exec on a paused sandbox vs an exec on a running one
    warm = []
    for sb in sbs[:30]:
        t = time.perf_counter()
        await sb.run_shell("true")
        warm.append(time.perf_counter() - t)
    await client.pause_job(job)
    thaw_exec = []
    for sb in sbs[:30]:
        t = time.perf_counter()
        await sb.run_shell("true")
        thaw_exec.append(time.perf_counter() - t)
    await client.resume_job(job)
    anon_left = [p.anon_bytes or 0 for p in rep.sandboxes]
    before = [p.memory_before_bytes or 0 for p in rep.sandboxes]
    after = [p.memory_after_bytes or 0 for p in rep.sandboxes]
    ft, warm_read = stats(first), stats(again)
    busy = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    out: dict[str, object] = {
        "sandboxes": n,
        "held_mib_each": mib,
        "fill": fill,
        "loadavg_before_pause": load,
        # all CPUs, whole host, during pause_job: user+nice (others' work: the platform
        # itself does ~1 ms per sandbox), system+softirq (the reclaim), iowait, idle
        "host_cpu_pct_during_pause": {
            k: round(100 * v / max(1, sum(busy)), 1)
            for k, v in zip(("user", "system", "iowait", "idle"), cpu_split(busy), strict=True)
        },
        "vmstat_during_pause": {
            k: vm1.get(k, 0) - vm0.get(k, 0) for k in ("pswpout", "thp_split_page")
        },
        "swpout_pages_in_large_folios": lf1["pages"] - lf0["pages"],
        "large_folios_split_for_swap": lf1["fallback_folios"] - lf0["fallback_folios"],
        "swap_available": rep.swap_available,
        "paused": rep.paused,
        "pause_job_wall_s": round(pause_wall, 3),
        "pause_per_sandbox_wall_ms": round(pause_wall / max(1, n) * 1e3, 3),
        "pause_each_freeze_plus_reclaim": stats([p.duration for p in rep.sandboxes]),
        "pause_each_freeze": stats([p.freeze_seconds for p in rep.sandboxes]),
        "pause_each_reclaim": stats([p.reclaim_seconds for p in rep.sandboxes]),
        "cgroup_usage_before_mib": round(sum(before) / MiB, 1),
        "cgroup_usage_after_mib": round(sum(after) / MiB, 1),
        "reclaimed_mib": round(rep.memory_reclaimed_bytes / MiB, 1),
        "anon_before_mib": round(rep.anon_before_bytes / MiB, 1),
        "anon_left_mib": round(sum(anon_left) / MiB, 1),
        "anon_returned_fraction": round(1 - sum(anon_left) / max(1, rep.anon_before_bytes), 3),
        "swapped_mib": round(sum(p.swap_bytes or 0 for p in rep.sandboxes) / MiB, 1),
        "host_memavailable_gain_mib": round((avail1 - avail0) / MiB, 1),
        "resume_job_wall_s": round(resume_wall, 4),
        "resume_per_sandbox_ms": round(resume_wall / max(1, res.resumed) * 1e3, 3),
        "first_touch_read_after_resume": ft,
        "warm_read": warm_read,
        "first_touch_cost_p50_ms": round(ft["p50_ms"] - warm_read["p50_ms"], 3),
        "first_touch_mib_per_s": round(mib / max(1e-9, ft["p50_ms"] / 1e3), 1),
        "exec_running": stats(warm),
        "exec_on_paused_transparent_thaw": stats(thaw_exec),
    }
    await asyncio.gather(*(sb.stop() for sb in sbs))
    return out


async def pack_and_fork(client: DSecClient, image: str, creates: int) -> dict[str, object]:
    src = await client.run_container(
        DSecContainerRunArgs(container_image=image, memory_limit_mb=256, ttl_running_stop=None)
    )
    r = await src.run_shell(
        "mkdir -p /root/data && for i in $(seq 1 100); do "
        "dd if=/dev/urandom of=/root/data/f$i bs=1M count=1 2>/dev/null; done; du -sm /root/data",
        timeout=120,
    )
    t = time.perf_counter()
    env = await src.pack_diff(name="bench-env", version="v1")
    pack_s = time.perf_counter() - t
    base_spec = DSecContainerRunArgs(container_image=image, memory_limit_mb=64)
    packed_spec = env.run_args(memory_limit_mb=64)
    base_t: list[float] = []
    packed_t: list[float] = []
    for i in range(creates * 2):
        spec = base_spec if i % 2 == 0 else packed_spec
        t = time.perf_counter()
        sb = await client.run_container(spec)
        (base_t if i % 2 == 0 else packed_t).append(time.perf_counter() - t)
        await sb.stop()
    check = await client.run_container(packed_spec)
    seen = (await check.run_shell("ls /root/data | wc -l")).stdout.strip()
    await check.stop()
    t = time.perf_counter()
    kids = await src.fork(16)
    fork_s = time.perf_counter() - t
    await asyncio.gather(*(k.stop() for k in kids))
    await src.stop()
    bs, ps = stats(base_t), stats(packed_t)
    return {
        "changes": r.stdout.strip(),
        "pack_diff_s": round(pack_s, 3),
        "pack_frozen_s": round(env.frozen_seconds, 3),
        "layer_mib": round(env.layer.size_bytes / MiB, 1),
        "files_seen_in_child": seen,
        "create_from_base": bs,
        "create_from_packed": ps,
        "packed_over_base_p50": round(ps["p50_ms"] / bs["p50_ms"], 3),
        "fork16_s": round(fork_s, 3),
    }


@contextlib.contextmanager
def swap_dir(gb: int) -> Iterator[Path | None]:
    """A directory for the bench's swap file, removed afterwards (the platform turns the
    file on and, at its clean shutdown, off; swapoff here too if it crashed)."""
    if gb <= 0:
        yield None
        return
    base = Path("/var/lib/dsec-bench-swap")
    base.mkdir(mode=0o700, exist_ok=True)
    try:
        yield base / "swap"
    finally:
        for area in swapmod.active_swaps():
            if Path(swapmod.area_file(area)).parent == base:
                swapmod.SwapFile(Path(area.filename), 0, activated=True).disable()
        (base / "swap").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            base.rmdir()


async def one_platform(
    n: int, mib: int, creates: int, fills: list[str], env: dict[str, str], pack: bool
) -> dict[str, object]:
    with platform_process(**env) as plat:
        client = DSecClient(plat.url, plat.api_key, timeout=600)
        await client.open()
        try:
            await client.build_image("busybox")
            image = "busybox:latest"
            out: dict[str, object] = {
                "swap_areas": [
                    f"{s.filename} {s.size_bytes // MiB} MiB" for s in swapmod.active_swaps()
                ],
                "pause_resume": await pause_resume(client, image, n, mib, fills[0]),
            }
            for extra in fills[1:]:
                out[f"pause_resume_{extra}"] = await pause_resume(client, image, n, mib, extra)
            if pack:
                out["pack_fork"] = await pack_and_fork(client, image, creates)
            return out
        finally:
            await client.close()


async def run(
    n: int,
    mib: int,
    creates: int,
    fill: str,
    zram: int,
    swap_gb: int,
    *,
    modes: list[str],
    no_swap_run: bool = True,
    fill_4k: bool = True,
) -> dict[str, object]:
    result: dict[str, object] = {"host": {"memavailable_mib": mem_available() // MiB}}
    with zram_swap(zram) as zdev:
        result["host"] = {
            "swap": swap_available(),
            "zram_swap": f"{zdev} {zram} MiB" if zdev else None,
            "memavailable_mib": mem_available() // MiB,
            "loadavg_start": loadavg(),
        }
        if no_swap_run:
            result["no_swap_file"] = await one_platform(n, mib, creates, [fill], {}, True)
    for mode in modes if swap_gb > 0 else []:
        # loop: the swap file through a loop device (the default); file: the file itself
        with swap_dir(swap_gb) as path:
            assert path is not None
            env = {"DSEC_SWAP_FILE": str(path), "DSEC_SWAP_GB": str(swap_gb)}
            env["DSEC_SWAP_LOOP"] = "1" if mode == "loop" else "0"
            fills = [fill, "random-4k"] if mode == "loop" and fill_4k else [fill]
            key = "swap_file" if mode == "loop" else "swap_file_no_loop"
            result[key] = await one_platform(n, mib, creates, fills, env, False)
        result["swap_areas_after"] = [s.filename for s in swapmod.active_swaps()]
    result["loadavg_end"] = loadavg()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--creates", type=int, default=30)
    ap.add_argument("--fill", choices=["zero", "random", "random-4k"], default="random")
    ap.add_argument(
        "--zram-mib", type=int, default=0, help="temporary zram swap of this size (0: none)"
    )
    ap.add_argument(
        "--swap-gb", type=int, default=8, help="swap-file run with this size (0: skip it)"
    )
    ap.add_argument(
        "--modes",
        default="loop,file",
        help="swap-file runs: loop (through a loop device, the default) and/or file",
    )
    ap.add_argument(
        "--skip-no-swap", action="store_true", help="only the swap-file runs (no pack/fork)"
    )
    ap.add_argument("--no-4k", action="store_true", help="skip the extra row with 4 KiB-page data")
    ap.add_argument("--out", default="rl.json")
    a = ap.parse_args()
    result = asyncio.run(
        run(
            a.n,
            a.mib,
            a.creates,
            a.fill,
            a.zram_mib,
            a.swap_gb,
            modes=[m for m in a.modes.split(",") if m],
            no_swap_run=not a.skip_no_swap,
            fill_4k=not a.no_4k,
        )
    )
    text = json.dumps(result, indent=2)
    print(text)
    out = REPO / "bench" / "results" / a.out
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
