"""Warm sandboxes on (`dsec up`'s default) against off, the same workloads in one run.

    .venv/bin/python bench/bench_warm.py [--creates 150] [--burst 32] [--rounds 2]

Why: the pool (dsec.edge.warmpool) starts a sandbox ahead after each create. That is a
win when creates come with pauses, but a refill could compete with creates that come
back to back. Per round, one fresh `dsec up` with DSEC_WARM_POOL=0 and one with 1 (the
order turns every round, so both see the host at the same moments) each run:

- ``kept``: ``--creates`` creates back to back, each sandbox kept (a job filling up);
- ``churn``: ``--creates`` times create then stop (an RL loop: the next create comes
  right after the previous sandbox's stop);
- ``burst``: ``--burst`` creates at once, then all stopped.

Prints p50/p99 per workload and side and the on/off ratios; writes
bench/results/warm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402

SPEC = DSecContainerRunArgs(
    container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
)


async def workloads(url: str, key: str, creates: int, burst: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"kept": [], "churn": [], "burst_s": []}
    async with DSecClient(url, api_key=key, timeout=300) as c:
        await c.build_image("busybox")
        for _ in range(5):  # the layer mounted, the page cache warm
            await (await c.run_container(SPEC)).stop()
        kept = []
        for _ in range(creates):
            t = time.perf_counter()
            kept.append(await c.run_container(SPEC))
            out["kept"].append(time.perf_counter() - t)
        await asyncio.gather(*(sb.stop() for sb in kept))
        for _ in range(creates):
            t = time.perf_counter()
            sb = await c.run_container(SPEC)
            out["churn"].append(time.perf_counter() - t)
            await sb.stop()
        t = time.perf_counter()
        many = await asyncio.gather(*(c.run_container(SPEC) for _ in range(burst)))
        out["burst_s"].append(time.perf_counter() - t)
        await asyncio.gather(*(sb.stop() for sb in many))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--creates", type=int, default=150)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args()
    samples: dict[str, dict[str, list[float]]] = {
        side: {"kept": [], "churn": [], "burst_s": []} for side in ("off", "on")
    }
    for r in range(opts.rounds):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            env = {"DSEC_WARM_POOL": "1" if side == "on" else "0"}
            with platform_process(**env) as plat:
                got = asyncio.run(workloads(plat.url, plat.api_key, opts.creates, opts.burst))
            for name, values in got.items():
                samples[side][name] += values
    res: dict[str, Any] = {}
    print(
        f"\n{'workload':42} {'off p50':>8} {'on p50':>8} {'on/off':>7} {'off p99':>8} {'on p99':>8}"
    )
    for name, label in (
        ("kept", "create back to back, kept (ms)"),
        ("churn", "create right after a stop (ms)"),
        ("burst_s", f"burst of {opts.burst} at once (s, whole burst)"),
    ):
        off, on = summary(samples["off"][name]), summary(samples["on"][name])
        res[name] = {"off": off, "on": on, "ratio_p50": on["p50_ms"] / off["p50_ms"]}
        scale = 1000.0 if name == "burst_s" else 1.0  # a burst is quoted in seconds
        row = [off["p50_ms"] / scale, on["p50_ms"] / scale, res[name]["ratio_p50"]]
        row += [off["p99_ms"] / scale, on["p99_ms"] / scale]
        print(f"{label:42} " + " ".join(f"{v:8.3f}" for v in row))
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "warm.json").write_text(json.dumps({"opts": vars(opts), **res}, indent=2))


if __name__ == "__main__":
    main()
