"""Single-node platform benchmark (issue 2, roadmap item 1), one run, side by side.

    .venv/bin/python bench/bench_platform.py [--rounds 200] [--creates 200] [--idle 500]
        [--execs 300] [--only-create] [--overlap] [--bare] [--settle-ms 50]

Starts its own `dsec up` on a fresh data directory, then measures through the SDK:

- the create ratio (issue 19's target, <= 1.25x): ``--rounds`` rounds, each one create
  through the SDK and one raw ``crun run --detach`` of the same EROFS layer with an
  own overlay and a default sandbox's cgroup limits (dsec.crun_baseline, create to
  ready; ``--bare`` adds a third arm with memory and pids limits only, the baseline
  before 2026-12-05), interleaved, the order turning every round, so all see the same
  host at the same moments; each sandbox is stopped and each raw container deleted
  untimed, and ``--settle-ms`` (50) passes before each timed create, so that neither
  arm runs beside the other's cleanup (the platform finishes a teardown after its stop
  answers). ``--overlap`` runs the
  rounds again with each create beside the previous sandbox's stop (an RL loop: the
  teardown competes with the create);
- create latency of ``--creates`` sandboxes kept, then stopped; creates right after
  a stop (churn); `run_shell("true")` latency with 1 and with N idle sandboxes, burst
  creation of N sandboxes, host memory per idle sandbox; and raw `crun run` of
  /bin/true in the foreground. ``--only-create`` skips these.

Creates are served by warm sandboxes (dsec.edge.warmpool, ``--warm 1``, `dsec up`'s
default): a create of the shape just created finds one started during the settle
time. ``--warm 0`` (DSEC_WARM_POOL=0) measures creates that start their own container.

Prints a table and writes bench/results/platform.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402
from dsec.crun_baseline import RawCrun, blob_path  # noqa: E402


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {
        "n": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": pct(ms, 99),
        "mean_ms": statistics.fmean(ms),
    }


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def mem_used_bytes() -> int:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, val = line.split(":", 1)
            info[key] = int(val.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


async def exec_latency(sb: Any, n: int) -> list[float]:
    for _ in range(20):  # warm the connection and the agent
        await sb.run_shell("true")
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await sb.run_shell("true")
        out.append(time.perf_counter() - t)
    return out


async def interleaved(
    client: DSecClient,
    spec: DSecContainerRunArgs,
    raw: RawCrun,
    rounds: int,
    *,
    overlap: bool = False,
    bare: RawCrun | None = None,
    settle: float = 0.0,
) -> dict[str, Any]:
    """Create via the SDK and raw ``crun run --detach``, one of each per round, the
    order alternating (ABBA), each undone untimed before the next round. ``overlap``:
    the previous round's sandbox is stopped while this round's create runs (an RL
    rollout loop), so its teardown competes with the create; raw crun is unchanged."""
    ours: list[float] = []
    theirs: list[float] = []
    bares: list[float] = []
    previous: Any = None
    arms = ("ours", "raw", "bare") if bare is not None else ("ours", "raw")
    for i in range(rounds + 3):  # 3 warm-up rounds
        samples: dict[str, float] = {}
        for who in arms[i % len(arms) :] + arms[: i % len(arms)]:  # the order turns
            # The platform tears a stopped sandbox down after stop() answers (cgroups,
            # page charges, directories: dsec.backends.container.backend); raw crun's
            # delete is done when it returns. A pause before each timed create lets the
            # host settle, so neither arm pays the other's cleanup (--settle-ms).
            await asyncio.sleep(settle)
            if who == "raw":
                samples[who] = raw.detached_once()
                continue
            if who == "bare":
                assert bare is not None
                samples[who] = bare.detached_once()
                continue
            stopping = asyncio.ensure_future(previous.stop()) if previous is not None else None
            t = time.perf_counter()
            sb = await client.run_container(spec)
            samples[who] = time.perf_counter() - t
            if stopping is not None:
                await stopping
            previous = None
            if overlap:
                previous = sb
            else:
                await sb.stop()
        if i >= 3:
            ours.append(samples["ours"])
            theirs.append(samples["raw"])
            if "bare" in samples:
                bares.append(samples["bare"])
    if previous is not None:
        await previous.stop()
    mine, base = summary(ours), summary(theirs)
    out = {
        "create_interleaved": mine,
        "raw_crun_detach": base,
        "ratio_p50": mine["p50_ms"] / base["p50_ms"],
        "ratio_p99": mine["p99_ms"] / base["p99_ms"],
    }
    if bares:
        old = summary(bares)
        out["raw_crun_detach_bare"] = old
        out["ratio_p50_bare"] = mine["p50_ms"] / old["p50_ms"]
    return out


async def run(opts: argparse.Namespace, url: str, key: str, data_dir: Path) -> dict[str, Any]:
    client = DSecClient(url, key, timeout=300)
    await client.open()
    results: dict[str, Any] = {}
    try:
        image = await client.build_image("busybox")
        spec = DSecContainerRunArgs(
            container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
        )
        for _ in range(10):  # warm-up: layer mount, page cache
            await (await client.run_container(spec)).stop()

        # 0. the create ratio: platform and raw crun --detach interleaved
        layer = image.layers[0]
        blob = blob_path(data_dir, layer)
        with RawCrun(layer_blob=blob) as raw, contextlib.ExitStack() as stack:
            bare = stack.enter_context(RawCrun(blob, limits="bare")) if opts.bare else None
            results["vs_raw"] = await interleaved(
                client, spec, raw, opts.rounds, bare=bare, settle=opts.settle_ms / 1000
            )
            if opts.overlap:
                results["vs_raw_overlap"] = await interleaved(
                    client, spec, raw, opts.rounds, overlap=True
                )
        if opts.only_create:
            return results

        # 1. create latency, sequential, through the SDK (sandboxes kept, then stopped)
        lat: list[float] = []
        kept = []
        for _ in range(opts.creates):
            t = time.perf_counter()
            kept.append(await client.run_container(spec))
            lat.append(time.perf_counter() - t)
        results["create"] = summary(lat)
        stop_lat: list[float] = []
        for sb in kept:
            t = time.perf_counter()
            await sb.stop()
            stop_lat.append(time.perf_counter() - t)
        results["stop"] = summary(stop_lat)

        # 1b. churn: create right after the previous sandbox's stop (RL rollout loop)
        churn: list[float] = []
        for _ in range(opts.creates // 2):
            t = time.perf_counter()
            sb = await client.run_container(spec)
            churn.append(time.perf_counter() - t)
            await sb.stop()
        results["create_after_stop"] = summary(churn)

        # 2. exec latency with 1 sandbox
        one = await client.run_container(spec)
        results["exec_n1"] = summary(await exec_latency(one, opts.execs))

        # 3. burst of N creates (concurrent), memory per idle sandbox
        before = mem_used_bytes()
        t = time.perf_counter()
        burst = await asyncio.gather(*(client.run_container(spec) for _ in range(opts.idle)))
        burst_s = time.perf_counter() - t
        await asyncio.sleep(2)
        after = mem_used_bytes()
        results["burst"] = {
            "n": opts.idle,
            "seconds": burst_s,
            "sandboxes_per_s": opts.idle / burst_s,
        }
        results["memory_per_idle_sandbox_mib"] = (after - before) / opts.idle / 2**20

        # 4. exec latency with N+1 sandboxes on the host
        results[f"exec_n{opts.idle + 1}"] = summary(await exec_latency(one, opts.execs))

        t = time.perf_counter()
        await asyncio.gather(*(sb.stop() for sb in [*burst, one]))
        results["stop_all_s"] = time.perf_counter() - t

        # 5. baseline: raw crun run on the same layer, same host, same run
        raw = RawCrun(layer_blob=blob_path(data_dir, layer))
        with raw:
            results["raw_crun_run"] = summary(raw.measure(opts.creates))
        results["ratio_create_ours_over_raw"] = (
            results["create"]["p50_ms"] / results["raw_crun_run"]["p50_ms"]
        )
    finally:
        await client.close()
    return results


def print_table(res: dict[str, Any], idle: int) -> None:
    v = res["vs_raw"]
    print(f"\n{'interleaved, one of each per round':58} {'n':>5} {'p50 ms':>9} {'p99 ms':>9}")
    for name, s in (
        ("create via SDK", v["create_interleaved"]),
        ("raw crun run --detach, same layer and limits", v["raw_crun_detach"]),
        *(
            [("raw crun, memory and pids limits only (--bare)", v["raw_crun_detach_bare"])]
            if "raw_crun_detach_bare" in v
            else []
        ),
    ):
        print(f"{name:58} {s['n']:>5} {s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f}")
    label = "create ours / raw, p50 (target <= 1.25) and p99"
    print(f"{label:58} {v['ratio_p50']:>15.2f} {v['ratio_p99']:>9.2f}")
    if "ratio_p50_bare" in v:
        print(f"{'create ours / raw --bare, p50':58} {v['ratio_p50_bare']:>15.2f}")
    o = res.get("vs_raw_overlap")
    if o is not None:
        for name, s in (
            ("create while the previous sandbox stops", o["create_interleaved"]),
            ("raw crun run --detach, same rounds", o["raw_crun_detach"]),
        ):
            print(f"{name:58} {s['n']:>5} {s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f}")
        print(f"{'  its ratio, p50 and p99':58} {o['ratio_p50']:>15.2f} {o['ratio_p99']:>9.2f}")
    if "create" not in res:
        return
    rows = [
        ("create via SDK (p50 <= 15 ms, p99 <= 40 ms)", res["create"]),
        ("raw crun run baseline", res["raw_crun_run"]),
        ("create right after a stop (churn)", res["create_after_stop"]),
        ("stop via SDK", res["stop"]),
        ("run_shell('true'), 1 sandbox (p50 <= 3 ms)", res["exec_n1"]),
        (f"run_shell('true'), {idle + 1} sandboxes (p50 <= 3 ms)", res[f"exec_n{idle + 1}"]),
    ]
    print(f"\n{'measure':58} {'n':>5} {'p50 ms':>9} {'p99 ms':>9}")
    for name, s in rows:
        print(f"{name:58} {s['n']:>5} {s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f}")
    print(f"{'create ours / raw crun (p50)':58} {res['ratio_create_ours_over_raw']:>25.2f}")
    b = res["burst"]
    label = f"burst of {b['n']} creates (>= 100/s)"
    print(f"{label:58} {b['sandboxes_per_s']:>19.1f} /s")
    print(
        f"{'host memory per idle sandbox (<= 1.5 MiB)':58} "
        f"{res['memory_per_idle_sandbox_mib']:>18.2f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=200, help="interleaved create/raw rounds")
    ap.add_argument("--only-create", action="store_true", help="only the interleaved rounds")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="interleaved rounds again, each create beside the previous sandbox's stop",
    )
    ap.add_argument(
        "--bare",
        action="store_true",
        help="a third arm: raw crun with memory and pids limits only (the baseline before "
        "it set a sandbox's limits), to compare with earlier figures",
    )
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=50.0,
        help="pause before each timed create of the interleaved rounds (0: back to back)",
    )
    ap.add_argument(
        "--warm",
        type=int,
        default=1,
        help="DSEC_WARM_POOL for the platform: warm sandboxes a shape (default 1, as "
        "`dsec up`'s; 0 measures creates that start their own container)",
    )
    ap.add_argument("--creates", type=int, default=200)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--execs", type=int, default=300)
    opts = ap.parse_args()
    os.environ.setdefault("DSEC_MAX_SANDBOXES", str(opts.idle + 100))
    load_start = loadavg()
    env = {"DSEC_WARM_POOL": str(opts.warm)}
    with platform_process(**env) as plat:
        res = asyncio.run(run(opts, plat.url, plat.api_key, plat.data_dir))
    res["host"] = {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        # the host is shared: other work running meanwhile moves every figure
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "platform.json").write_text(json.dumps(res, indent=2))
    print_table(res, opts.idle)


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
