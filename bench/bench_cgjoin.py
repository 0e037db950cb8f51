"""Create cost with N idle sandboxes present, this tree against a baseline, and where
crun's kernel time goes (issue 19: a sandbox joins only the cgroup hierarchies the
platform uses).

    .venv/bin/python bench/bench_cgjoin.py [--baseline-rev main] [--idle 150]
        [--rounds 6] [--creates 8] [--perf] [--perf-creates 40]

Starts two platforms (this tree, and the baseline checked out beside it, see
bench/baseline.py), builds busybox on both and leaves ``--idle`` sandboxes running on
each (both count: the kernel's walks cover every cgroup on the host). Then alternates
batches of ``--creates`` sequential create + stop (create timed; the order turns every
round) and prints create p50/p99 per side and their ratio.

``--perf``: afterwards, per side, ``perf record -g`` of that platform's process tree
(and what it starts) during ``--perf-creates`` more creates, and the
CPU time per create (ms) that processes named ``crun`` spent in each kernel function
that grows with N (children included): cpuset (validate_change,
update_domain_attr_tree, dl_rebuild_rd_accounting), v1 mounts in the container
(cgroup1_get_tree, cgroup_lock_and_drain_offline), CFS bandwidth (tg_set_cfs_bandwidth
/ tg_set_bandwidth, walk_tg_tree_from), cgroup creation and moves. Only the side's
own processes are sampled: another platform's crun on a shared host is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.baseline import baseline_tree  # noqa: E402
from bench.stats import pct  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402

SPEC = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
FREQ = 999
SYMBOLS = (
    "cpuset_write_resmask",
    "validate_change",
    "update_domain_attr_tree",
    "dl_rebuild_rd_accounting",
    "rebuild_sched_domains_locked",
    "cgroup1_get_tree",
    "cgroup_lock_and_drain_offline",
    "tg_set_cfs_bandwidth",
    "tg_set_bandwidth",
    "walk_tg_tree_from",
    "cgroup_mkdir",
    "cgroup_rmdir",
    "cgroup_attach_task",
    "cgroup_migrate_execute",
)


async def batch(client: DSecClient, n: int, out: list[float]) -> None:
    for _ in range(n):
        t = time.perf_counter()
        sb = await client.run_container(SPEC)
        out.append(time.perf_counter() - t)
        await sb.stop()


async def fill(client: DSecClient, n: int) -> list[Any]:
    """``n`` idle sandboxes, 8 at a time."""
    kept: list[Any] = []
    while len(kept) < n:
        k = min(8, n - len(kept))
        kept += await asyncio.gather(*(client.run_container(SPEC) for _ in range(k)))
    return kept


def perf_report(data: Path, creates: int) -> dict[str, float]:
    """ms of CPU per create in each of SYMBOLS (children included), comm crun."""
    header = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--sort", "comm", "-g", "none"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    m = re.search(r"# Event count \(approx.\): (\d+)", header)
    cpu_ms = int(m.group(1)) / 1e6 if m else 0.0  # cpu-clock: ns of CPU sampled
    argv = ["perf", "report", "-i", str(data), "--stdio", "--children", "--sort", "sym"]
    argv += ["-g", "none", "--comm", "crun", "--percentage", "absolute"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    found: dict[str, float] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[-1] in SYMBOLS:
            found[parts[-1]] = float(parts[0].rstrip("%"))
    crun = re.search(r"^\s*([\d.]+)%\s+[\d.]+%\s+crun\s*$", header, re.M)
    ms = {s: p / 100 * cpu_ms / creates for s, p in found.items()}
    if crun:
        ms["(all of crun)"] = float(crun.group(1)) / 100 * cpu_ms / creates
    return ms


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it now (the platform and its spawner)."""
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [root], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        tree += kids
        todo += kids
    return tree


async def perf_batch(client: DSecClient, root: int, n: int, data: Path) -> None:
    """perf record of the platform's process tree (and what it starts from now on:
    crun-wrap, crun, the sandboxes) during ``n`` creates: other processes on the host,
    other platforms' crun among them, are not sampled."""
    pids = ",".join(str(p) for p in process_tree(root))
    rec = await asyncio.create_subprocess_exec(
        *["perf", "record", "-g", "-F", str(FREQ), "-o", str(data), "-p", pids],
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await asyncio.sleep(1.0)
        await batch(client, n, [])
    finally:
        rec.send_signal(signal.SIGINT)
        await asyncio.wait_for(rec.wait(), 60)


async def run(opts: argparse.Namespace, plats: dict[str, Any], tmp: Path) -> None:
    clients = {side: DSecClient(p.url, p.api_key, timeout=300) for side, p in plats.items()}
    kept: dict[str, list[Any]] = {}
    times: dict[str, list[float]] = {side: [] for side in plats}
    try:
        for c in clients.values():
            await c.open()
            await c.build_image("busybox")
            await batch(c, 5, [])  # warm-up: layer mount, page cache
        for side, c in clients.items():
            kept[side] = await fill(c, opts.idle)
        for i in range(opts.rounds):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for side in order:
                await batch(clients[side], opts.creates, times[side])
        print(f"{'side':5} {'create p50':>10} {'p99':>8}  (ms, {opts.idle} idle sandboxes each)")
        for side, ts in times.items():
            ms = [t * 1000 for t in ts]
            print(f"{side:5} {statistics.median(ms):10.2f} {pct(ms, 99):8.2f}")
        new, old = (statistics.median(times[s]) for s in ("new", "old"))
        print(f"ratio new/old p50: {new / old:.3f}")
        if opts.perf:
            # Windows alternate between the sides (the host's cgroup count drifts: other
            # work on it), each side's figure the mean over its windows.
            windows = 4
            per = max(1, opts.perf_creates // windows)
            reports: dict[str, dict[str, float]] = {side: {} for side in clients}
            for w in range(windows):
                order = list(clients) if w % 2 == 0 else list(reversed(clients))
                for side in order:
                    data = tmp / f"perf-{side}-{w}.data"
                    await perf_batch(clients[side], plats[side].proc.pid, per, data)
                    for sym, cost in perf_report(data, per).items():
                        reports[side][sym] = reports[side].get(sym, 0.0) + cost / windows
            print("kernel CPU ms per create in processes named crun (children included):")
            for sym in [*SYMBOLS, "(all of crun)"]:
                a, b = reports["new"].get(sym, 0.0), reports["old"].get(sym, 0.0)
                if a or b:
                    print(f"  {sym:32} new {a:7.3f}  old {b:7.3f}")
    finally:
        for side, c in clients.items():
            for sb in kept.get(side, []):
                with contextlib.suppress(Exception):
                    await sb.stop()
            await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default="main")
    ap.add_argument("--idle", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--creates", type=int, default=8)
    ap.add_argument("--perf", action="store_true")
    ap.add_argument("--perf-creates", type=int, default=40)
    opts = ap.parse_args()
    load = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_tree(opts.baseline_rev))
        tmp = Path(tempfile.mkdtemp(prefix="dsec-cgjoin-perf-"))  # kept: perf report -i
        plats = {"new": stack.enter_context(platform_process())}
        plats["old"] = stack.enter_context(platform_process(PYTHONPATH=str(base / "src")))
        asyncio.run(run(opts, plats, tmp))
    print(f"baseline {opts.baseline_rev}; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"perf data (if any) in {tmp}")


if __name__ == "__main__":
    main()
