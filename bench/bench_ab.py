"""The normal path, this tree against a baseline revision, interleaved in one run.

    .venv/bin/python bench/bench_ab.py [--baseline-rev a8ffc59] [--rounds 10]
    .venv/bin/python bench/bench_ab.py --baseline-rev . --baseline-env DSEC_METRICS=0 --control

Starts two platforms side by side (this tree, and the baseline checked out in a git
worktree, see bench/baseline.py; ``--baseline-rev .``: this tree again, set apart by
``--baseline-env``), builds busybox on both, then alternates small batches (new, old,
new, old, ...; the order turns every round): ``--creates`` sequential creates (each
stopped after), then ``--execs`` ``run_shell("true")`` on a kept sandbox, so both sides
see the same host load. Prints create, stop and exec p50/p99 per side and the new/old
ratios (the issue 12 target: nothing in the normal path slower by more than 5%; issue
18: metrics cost the create path under 2%), with the spread of the rounds' ratios.

``--control`` adds a third platform exactly like "new" to the rotation: its ratio to
"new" (an A/A comparison in the same run) is the noise floor a new/old ratio has to be
read against; on a loaded host it is easily a few percent.
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


Samples = dict[str, dict[str, list[float]]]  # side -> measure -> seconds
Rounds = list[Samples]  # one Samples per round


async def run(opts: argparse.Namespace, plats: dict[str, Any]) -> Rounds:
    rounds: Rounds = []
    clients = {side: DSecClient(p.url, p.api_key, timeout=300) for side, p in plats.items()}
    try:
        for c in clients.values():
            await c.open()
            await c.build_image("busybox")
            for _ in range(10):  # warm-up: layer mount, page cache
                await (await c.run_container(SPEC)).stop()
        for i in range(opts.rounds):
            sides = list(clients)
            order = sides[i % len(sides) :] + sides[: i % len(sides)]
            if i // len(sides) % 2:
                order.reverse()
            samples: Samples = {side: {"create": [], "stop": [], "exec": []} for side in plats}
            for side in order:
                await batch(clients[side], opts, samples[side])
            rounds.append(samples)
    finally:
        for c in clients.values():
            await c.close()
    return rounds


def merged(rounds: Rounds, side: str, key: str) -> list[float]:
    """Every sample of ``side``'s ``key``, in milliseconds."""
    return [s * 1000 for r in rounds for s in r[side][key]]


def round_ratios(rounds: Rounds, a: str, b: str, key: str) -> list[float]:
    """a's p50 / b's p50 of each round: their spread is the noise a ratio of the
    whole run has to be read against (the host's load drifts between rounds)."""
    return sorted(statistics.median(r[a][key]) / statistics.median(r[b][key]) for r in rounds)


def report(rounds: Rounds, a: str = "new", b: str = "old") -> None:
    """p50 and p99 of both sides in ms, the ratio of the run's p50s and the spread of
    the rounds' p50 ratios."""
    print(
        f"{'measure':8} {a + ' p50':>9} {b + ' p50':>9} {'ratio':>6} {a + ' p99':>9} "
        f"{b + ' p99':>9}   per-round p50 ratios: median [min, max]"
    )
    for key in ("create", "stop", "exec"):
        n, o = merged(rounds, a, key), merged(rounds, b, key)
        n50, o50 = statistics.median(n), statistics.median(o)
        rr = round_ratios(rounds, a, b, key)
        print(
            f"{key:8} {n50:9.2f} {o50:9.2f} {n50 / o50:6.3f} {pct(n, 99):9.2f} {pct(o, 99):9.2f}"
            f"   {statistics.median(rr):.3f} [{rr[0]:.3f}, {rr[-1]:.3f}]"
        )


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
    ap.add_argument("--control", action="store_true", help="a third side like new (A/A)")
    opts = ap.parse_args()
    load = os.getloadavg()[0]
    env = dict(kv.split("=", 1) for kv in opts.baseline_env)
    with contextlib.ExitStack() as stack:
        if opts.baseline_rev != ".":
            base = stack.enter_context(baseline_tree(opts.baseline_rev))
            env["PYTHONPATH"] = str(base / "src")
        new_env = dict(kv.split("=", 1) for kv in opts.new_env)
        plats = {"new": stack.enter_context(platform_process(**new_env))}
        plats["old"] = stack.enter_context(platform_process(**env))
        if opts.control:
            plats["ctl"] = stack.enter_context(platform_process(**new_env))
        rounds = asyncio.run(run(opts, plats))
    print(
        f"baseline {opts.baseline_rev} {env}; new {new_env}; {opts.rounds} rounds; "
        f"load {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    report(rounds)
    if opts.control:
        print("A/A: this tree against itself (the noise floor)")
        report(rounds, "ctl", "new")


if __name__ == "__main__":
    main()
