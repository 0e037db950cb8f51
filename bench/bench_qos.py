"""CPU QoS classes (issue 19, item 1): a latency sandbox's command loop under 50%
best-effort CPU load, with and without QoS, one run, interleaved.

    .venv/bin/python bench/bench_qos.py [--rounds 40] [--batch-ms 250] [--burners 1]

Starts its own `dsec up` on a fresh data directory. One latency-class sandbox runs
``run_shell("true")`` in a loop; ``--burners`` sandboxes of ``--burner-cpus`` cores
each run one busy loop: by default one loop in one sandbox of one core, which keeps
one of this host's two cores busy all the time (50% load). The conditions run in
many short rounds, their order turning every round, so all see the same host load:

- idle: no burner runs (the unloaded arm, measured in the same rounds);
- with QoS: the burners are ``qos="best_effort"`` (SCHED_IDLE, cpu.shares 2);
- without QoS: the same burners as ``qos="latency"`` (what every sandbox was before);
- tasks only: the best-effort burners with their cgroup's ``cpu.idle`` turned off by
  this bench (SCHED_IDLE tasks and the lowest weight only), to show what the idle
  cgroup adds (where the kernel has ``cpu.idle``);
- weight only: the best-effort burners with ``cpu.idle`` off and their tasks put back
  at SCHED_OTHER by this bench (the lowest weight alone), to show what SCHED_IDLE
  costs and buys. The kernel counts a core that runs only SCHED_IDLE work as idle
  when it places a waking task (``sched_idle_cpu``), so the loop's tasks are woken
  onto the burner's core, one after another, while the other core sleeps: the tail
  of a partly loaded host. With the weight alone that placement goes away, but a
  fully loaded host (``--burners 2``) then preempts the burners only at a tick.

A batch runs commands for ``--batch-ms`` rather than a count. Two burners of 0.5 core
each (``--burners 2 --burner-cpus 0.5``, the first version of this bench) are not a
steady 50%: a 0.5-core limit is a CFS quota (50 ms of every 100 ms period) and two
burners started together run and are throttled in phase, so the host swings between
both cores busy and none, and the p50 of a closed command loop then mostly samples the
fast phase (more commands fit in it). The mean (the loop's slowdown) counts both.

Reports per condition the pooled p50/p99 and two inflations over idle: pooled
(loaded p50 / idle p50 - 1) and per round (the median over rounds of the rounds' p50s,
loaded over unloaded, - 1), the steadier figure on a shared host whose other work
comes in bursts that spoil some rounds of every arm. It also checks from the host what
QoS relies on: every task of a best-effort burner at SCHED_IDLE, the edge (which
carries every command) not at SCHED_IDLE; and how busy the host's cores were (all of
their work, ours included) during each arm.
Writes bench/results/qos.json.
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

from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402
from dsec.resources import cgroups, qos  # noqa: E402

BURN = "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! > /tmp/burn.pid"
UNBURN = "kill $(cat /tmp/burn.pid)"
CONDITIONS = ("idle", "with_qos", "without_qos", "tasks_only", "weight_only")


def spec(qos: str, cpus: float) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image="busybox:latest",
        memory_limit_mb=64,
        cpu_cores_limit=cpus,
        ttl_running_stop=None,
        qos=qos,
    )


def burner_policies(edge_id: str, sids: list[str]) -> dict[str, int]:
    """How many tasks of the burners' cgroups run under each scheduling policy (read
    from the host: what the kernel does, not what the platform meant to set)."""
    host = cgroups.detect()
    base = host.v1.get("cpu", host.v2)
    if base is None:
        return {}
    names = {os.SCHED_IDLE: "idle", os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch"}
    out: dict[str, int] = {}
    for sid in sids:
        tasks = base / f"dsec/{edge_id}/{sid}" / ("tasks" if "cpu" in host.v1 else "cgroup.threads")
        for tid in tasks.read_text().split():
            try:
                pol = names.get(os.sched_getscheduler(int(tid)), "other-class")
            except ProcessLookupError:
                continue
            out[pol] = out.get(pol, 0) + 1
    return out


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole host so far (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


async def loop_for(sb: Any, seconds: float) -> list[float]:
    """``run_shell("true")`` back to back for ``seconds``; each one's latency."""
    out = []
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        await sb.run_shell("true")
        out.append(time.perf_counter() - t)
    return out


async def loop(sb: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await sb.run_shell("true")
        out.append(time.perf_counter() - t)
    return out


def cpu_cgroup(edge_id: str, sid: str) -> Path:
    host = cgroups.detect()
    rel = f"dsec/{edge_id}/{sid}"
    return host.v1["cpu"] / rel if "cpu" in host.v1 else host.v2 / rel  # type: ignore[operator]


def set_cgroup_idle(edge_id: str, sid: str, on: bool) -> None:
    """The bench's knob for the ``tasks_only`` and ``weight_only`` conditions (the
    platform sets it on)."""
    (cpu_cgroup(edge_id, sid) / "cpu.idle").write_text("1" if on else "0")


def set_tasks_policy(edge_id: str, sid: str, policy: int) -> None:
    """The bench's knob for ``weight_only``: every task of the sandbox at ``policy``
    (from the host, as root; a sandbox cannot leave SCHED_IDLE by itself)."""
    cg = cpu_cgroup(edge_id, sid)
    for tid in (
        (cg / ("tasks" if (cg / "tasks").exists() else "cgroup.threads")).read_text().split()
    ):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


async def run(
    opts: argparse.Namespace, url: str, key: str, edge_id: str, edge_pid: int | None = None
) -> dict[str, Any]:
    made: list[Any] = []
    async with DSecClient(url, key, timeout=300) as client:
        await client.build_image("busybox")
        try:
            probe = await client.run_container(spec("latency", 1.0))
            made.append(probe)
            burners = {
                "with_qos": [
                    await client.run_container(spec("best_effort", opts.burner_cpus))
                    for _ in range(opts.burners)
                ],
                "without_qos": [
                    await client.run_container(spec("latency", opts.burner_cpus))
                    for _ in range(opts.burners)
                ],
            }
            made += burners["with_qos"] + burners["without_qos"]
            conditions = CONDITIONS if cgroups.detect().has_cpu_idle else CONDITIONS[:3]
            for cond in conditions[3:]:
                burners[cond] = burners["with_qos"]
            await loop(probe, 20)  # warm the connection and the agent
            samples: dict[str, list[float]] = {c: [] for c in conditions}
            per_round: dict[str, list[float]] = {c: [] for c in conditions}
            policies: dict[str, int] = {}
            busy: dict[str, list[float]] = {c: [] for c in conditions}
            for r in range(opts.rounds):
                # rotate the order so no condition always follows another
                k = r % len(conditions)
                for cond in conditions[k:] + conditions[:k]:
                    load = burners.get(cond, [])
                    for sb in burners["with_qos"]:
                        set_cgroup_idle(edge_id, sb.id, cond not in ("tasks_only", "weight_only"))
                    for sb in load:
                        await sb.run_shell(BURN)
                        if cond == "weight_only":
                            set_tasks_policy(edge_id, sb.id, os.SCHED_OTHER)
                    await asyncio.sleep(opts.settle)  # let the loops take their share
                    if cond == "with_qos" and not policies:
                        policies = burner_policies(edge_id, [sb.id for sb in load])
                    b0 = busy_jiffies()
                    got = await loop_for(probe, opts.batch_ms / 1000)
                    b1 = busy_jiffies()
                    busy[cond].append((b1[0] - b0[0]) / max(1, b1[1] - b0[1]))
                    samples[cond] += got
                    per_round[cond].append(statistics.median(got))
                    for sb in load:
                        await sb.run_shell(UNBURN)
                        if cond == "weight_only":
                            set_tasks_policy(edge_id, sb.id, os.SCHED_IDLE)
        finally:
            await asyncio.gather(*(sb.stop() for sb in made), return_exceptions=True)
    res: dict[str, Any] = {c: summary(s) for c, s in samples.items()}
    idle = res["idle"]["p50_ms"]
    for cond in samples.keys() - {"idle"}:
        res[cond]["inflation_p50"] = res[cond]["p50_ms"] / idle - 1
        res[cond]["inflation_p99"] = res[cond]["p99_ms"] / res["idle"]["p99_ms"] - 1
        # The median over rounds of each round's p50, loaded over unloaded: a burst of
        # other work spoils a few rounds of any arm, and the median passes over them
        # (a median of per-round ratios would not: its denominators are as noisy).
        res[cond]["inflation_p50_per_round"] = (
            statistics.median(per_round[cond]) / statistics.median(per_round["idle"]) - 1
        )
    for cond in samples:
        res[cond]["mean_ms"] = round(statistics.fmean(samples[cond]) * 1000, 3)
    for cond in samples.keys() - {"idle"}:
        res[cond]["inflation_mean"] = res[cond]["mean_ms"] / res["idle"]["mean_ms"] - 1
    for cond in samples:
        res[cond]["host_busy"] = round(statistics.median(busy[cond]), 3)
        res[cond]["round_p50_ms"] = [round(v * 1000, 3) for v in per_round[cond]]
        res[cond]["round_host_busy"] = [round(v, 3) for v in busy[cond]]
    res["checks"] = {
        "best_effort_burner_tasks_by_policy": policies,
        "edge_policy": {os.SCHED_IDLE: "idle"}.get(os.sched_getscheduler(edge_pid), "not idle")
        if edge_pid
        else "unknown",
        "core_scheduling": qos.health_detail()["core_scheduling"],
    }
    return res


def loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as fh:
        return " ".join(fh.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batch-ms", type=float, default=250.0, help="each batch's length")
    ap.add_argument("--settle", type=float, default=0.1, help="seconds before a batch")
    ap.add_argument("--burners", type=int, default=1)
    ap.add_argument("--burner-cpus", type=float, default=1.0, help="each burner's CPU limit")
    opts = ap.parse_args()
    load_start = loadavg()
    with platform_process() as plat:
        pid = plat.proc.pid if plat.proc else None
        res = asyncio.run(run(opts, plat.url, plat.api_key, plat.edge_id, pid))
    res["host"] = {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "loadavg_start": load_start,  # shared host: other work moves every figure
        "loadavg_end": loadavg(),
        "burners": opts.burners,
        "burner_cpus": opts.burner_cpus,
    }
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "qos.json").write_text(json.dumps(res, indent=2))
    print(
        f"\n{'run_shell(true) of a latency sandbox':40} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}"
        "   inflation: pooled p50, per-round p50, p99, mean; host busy"
    )
    load = f"{min(1.0, opts.burners * opts.burner_cpus / (os.cpu_count() or 1)):.0%} load"
    labels = {
        "idle": "no load",
        "with_qos": f"{load}, best_effort burners (QoS)",
        "without_qos": f"{load}, latency burners (no QoS)",
        "tasks_only": f"{load}, best_effort, cgroup not idle",
        "weight_only": f"{load}, best_effort, weight only",
    }
    for cond in (c for c in CONDITIONS if c in res):
        s = res[cond]
        extra = (
            f"   {s['inflation_p50']:+.1%}, {s['inflation_p50_per_round']:+.1%}, "
            f"{s['inflation_p99']:+.1%}, {s['inflation_mean']:+.1%}"
            if "inflation_p50" in s
            else ""
        )
        extra += f"; {s['host_busy']:.0%}"
        print(f"{labels[cond]:40} {s['n']:>5} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f}{extra}")
    print(f"host load {load_start} -> {res['host']['loadavg_end']}; checks {res['checks']}")


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
