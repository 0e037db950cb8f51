"""Batch creation vs individual creates, one run, side by side (issue 8, "Batch jobs").

    .venv/bin/python bench/bench_batch.py [--count 200] [--parallelism default,4,16,32]

Starts its own `dsec up` on a fresh data directory and builds busybox, then creates
``count`` busybox sandboxes (a) as one batch (`client.create_batch`) for each
parallelism asked, and (b) as ``count`` concurrent `client.run_container` calls (all
at once, as a caller without batches would). Reports sandboxes/s to the last one,
time-to-created per sandbox as the client sees it (p50/p99, from the request), and
the platform process's CPU per sandbox. Everything is stopped between rounds. Writes
bench/results/batch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402
from dsec.api.batch import BatchCreated  # noqa: E402
from dsec.control.batch import default_parallelism  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and its reaped children (the spawner's work)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def report(
    name: str, latencies: list[float], wall: float, failed: int, cpu: float
) -> dict[str, Any]:
    ms = [s * 1000 for s in latencies]
    n = len(ms)
    return {
        "mode": name,
        "created": n,
        "failed": failed,
        "wall_s": round(wall, 3),
        "sandboxes_per_s": round(n / wall, 1) if wall > 0 else 0.0,
        "p50_ms": round(statistics.median(ms), 1) if ms else None,
        "p99_ms": round(pct(ms, 99), 1) if ms else None,
        "server_cpu_ms_per_sandbox": round(cpu * 1000 / max(n, 1), 1),
    }


async def stop_all(client: DSecClient) -> None:
    live = await client.list_sandboxes()
    sem = asyncio.Semaphore(16)

    async def stop(sb: Any) -> None:
        async with sem:
            await sb.stop()

    await asyncio.gather(*(stop(sb) for sb in live))


async def batch_round(
    client: DSecClient, args: DSecContainerRunArgs, count: int, parallelism: int | None, pid: int
) -> dict[str, Any]:
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    batch = await client.create_batch(args, count=count, job="bench-batch", parallelism=parallelism)
    latencies: list[float] = []
    async for event in batch:
        if isinstance(event, BatchCreated):
            latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    label = f"batch p={parallelism or default_parallelism()}"
    return report(label, latencies, wall, len(batch.failures), cpu)


async def individual_round(
    client: DSecClient, args: DSecContainerRunArgs, count: int, pid: int
) -> dict[str, Any]:
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    latencies: list[float] = []
    failed = 0

    async def one() -> None:
        nonlocal failed
        start = time.perf_counter()
        try:
            await client.run_container(args)
        except Exception:
            failed += 1
            return
        latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one() for _ in range(count)))
    wall = time.perf_counter() - t0
    return report("individual", latencies, wall, failed, cpu_seconds(pid) - cpu0)


async def run(opts: argparse.Namespace, url: str, key: str, pid: int) -> list[dict[str, Any]]:
    args = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
    rows: list[dict[str, Any]] = []
    async with DSecClient(url, key, max_connections=max(256, opts.count)) as client:
        await client.build_image("busybox")
        for _ in range(10):  # warm up the create path
            await (await client.run_container(args)).stop()
        for p in opts.parallelism.split(","):
            rows.append(
                await batch_round(client, args, opts.count, None if p == "default" else int(p), pid)
            )
            await stop_all(client)
            print(json.dumps(rows[-1]), flush=True)
            rows.append(await individual_round(client, args, opts.count, pid))
            await stop_all(client)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--parallelism", default="default,4,16,32")
    opts = ap.parse_args()
    with platform_process() as plat:
        assert plat.proc is not None
        rows = asyncio.run(run(opts, plat.url, plat.api_key, plat.proc.pid))
    print(
        f"\n{'mode':<16}{'created':>8}{'failed':>7}{'/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'cpu ms':>8}"
    )
    for r in rows:
        print(
            f"{r['mode']:<16}{r['created']:>8}{r['failed']:>7}{r['sandboxes_per_s']:>8}"
            f"{r['p50_ms']:>9}{r['p99_ms']:>9}{r['server_cpu_ms_per_sandbox']:>8}"
        )
    out = REPO / "bench" / "results" / "batch.json"
    out.write_text(
        json.dumps({"count": opts.count, "cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
