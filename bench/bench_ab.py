"""The normal path, this tree against a baseline revision, interleaved in one run.

    .venv/bin/python bench/bench_ab.py [--baseline-rev a8ffc59] [--rounds 10]

Starts two platforms side by side (this tree, and the baseline checked out in a git
worktree, see bench/baseline.py), builds busybox on both, then alternates small batches
(new, old, new, old, ...): ``--creates`` sequential creates (each stopped after), then
``--execs`` ``run_shell("true")`` on a kept sandbox, so both sides see the same host
load. Prints create, stop and exec p50/p99 per side and the new/old ratios (the issue
12 target: nothing in the normal path slower by more than 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
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


async def batch(client: DSecClient, opts: argparse.Namespace, out: dict[str, list[float]]) -> None:
    for _ in range(opts.creates):
        t = time.perf_counter()
        sb = await client.run_container(SPEC)
        out["create"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.stop()
        out["stop"].append(time.perf_counter() - t)
    sb = await client.run_container(SPEC)
    try:
        for _ in range(10):
            await sb.run_shell("true")
        for _ in range(opts.execs):
            t = time.perf_counter()
            await sb.run_shell("true")
            out["exec"].append(time.perf_counter() - t)
    finally:
        await sb.stop()


async def run(opts: argparse.Namespace, plats: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {
        side: {"create": [], "stop": [], "exec": []} for side in plats
    }
    clients = {side: DSecClient(p.url, p.api_key, timeout=300) for side, p in plats.items()}
    try:
        for c in clients.values():
            await c.open()
            await c.build_image("busybox")
            for _ in range(10):  # warm-up: layer mount, page cache
                await (await c.run_container(SPEC)).stop()
        for i in range(opts.rounds):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for side in order:
                await batch(clients[side], opts, samples[side])
    finally:
        for c in clients.values():
            await c.close()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default="a8ffc59", help="'.': this tree (see --baseline-env)")
    ap.add_argument(
        "--baseline-env", action="append", default=[], help="KEY=VALUE for the baseline's platform"
    )
    ap.add_argument("--new-env", action="append", default=[], help="KEY=VALUE for this tree's")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--creates", type=int, default=20)
    ap.add_argument("--execs", type=int, default=100)
    opts = ap.parse_args()
    load = os.getloadavg()[0]
    env = dict(kv.split("=", 1) for kv in opts.baseline_env)
    with contextlib.ExitStack() as stack:
        if opts.baseline_rev != ".":
            base = stack.enter_context(baseline_tree(opts.baseline_rev))
            env["PYTHONPATH"] = str(base / "src")
        new = stack.enter_context(platform_process(**dict(kv.split("=", 1) for kv in opts.new_env)))
        old = stack.enter_context(platform_process(**env))
        samples = asyncio.run(run(opts, {"new": new, "old": old}))
    print(f"baseline {opts.baseline_rev} {env}; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'measure':8} {'new p50':>9} {'old p50':>9} {'ratio':>6} {'new p99':>9} {'old p99':>9}")
    for key in ("create", "stop", "exec"):
        n = [s * 1000 for s in samples["new"][key]]
        o = [s * 1000 for s in samples["old"][key]]
        n50, o50 = statistics.median(n), statistics.median(o)
        print(f"{key:8} {n50:9.2f} {o50:9.2f} {n50 / o50:6.3f} {pct(n, 99):9.2f} {pct(o, 99):9.2f}")


if __name__ == "__main__":
    main()
