"""Trajectory log and replay (issue 6, DSEC.md §6.2): cost of logging, speed of replay.

    .venv/bin/python bench/bench_replay.py [--steps 10000]

On a fresh `dsec up`: a rollout of ``--steps`` non-idempotent steps (each appends a line
to a side-effect counter file in the sandbox) is recorded for real in batches, then
replayed from the log by a "resumed trainer" (``run_many``: batches of 2,000 steps per
request). Proof of zero executions: the counter file still has exactly ``--steps``
lines afterwards, and every answer says ``replayed``. Also: per-step latency of a single
logged step vs a plain command (data path and API exec route), single-step replay, and
the log's own write cost in process (begin + finish, SQLite WAL).

Target: replay >= 10,000 steps/s. Writes bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient  # noqa: E402
from dsec.api.exec import ExecRequest, TrajectoryRef  # noqa: E402
from dsec.rl.trajectory import TrajectoryLog  # noqa: E402

COUNTER = "/tmp/counter"


def stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], 3),
    }


def log_cost(n: int = 5000) -> dict[str, dict[str, float]]:
    """begin (pending row + trajectory + binding, one transaction) and finish, in process."""
    with tempfile.TemporaryDirectory(prefix="dsec-brl-") as tmp:
        tlog = TrajectoryLog(Path(tmp) / "trajectory.db")
        begin: list[float] = []
        finish: list[float] = []
        req = json.dumps({"sandbox_id": "x", "op": "exec", "command": {"command": "true"}})
        res = json.dumps({"exit_code": 0, "stdout": "", "stderr": "", "duration": 0.001})
        for i in range(n):
            t = time.perf_counter()
            tlog.begin("job", "r", i, "sbx", "exec", "h" * 32, req)
            begin.append(time.perf_counter() - t)
            t = time.perf_counter()
            tlog.finish("job", "r", i, True, res)
            finish.append(time.perf_counter() - t)
        tlog.close()
    return {"log_begin": stats(begin), "log_finish": stats(finish)}


async def main(steps: int, latency_n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": steps}
    with platform_process() as plat:
        with DSecSyncClient(plat.url, plat.api_key) as sync:
            sync.build_image("busybox")
        async with DSecClient(plat.url, plat.api_key) as client:
            args = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=128)
            async with await client.run_container(args) as sb:
                commands = [f"echo {i} >> {COUNTER}" for i in range(steps)]

                # 1. record: every step runs for real and is logged before it is answered
                traj = client.trajectory("bench", "rollout")
                t = time.perf_counter()
                await traj.run_many(sb, commands)
                rec_s = time.perf_counter() - t
                lines = int((await sb.run_shell(f"wc -l < {COUNTER}")).stdout)
                assert lines == steps and traj.executed == steps, (lines, traj.executed)
                out["record"] = {
                    "seconds": round(rec_s, 3),
                    "steps_per_s": round(steps / rec_s),
                    "executions": traj.executed,
                }

                # 2. replay: a resumed trainer sends the same steps again
                again = client.trajectory("bench", "rollout")
                t = time.perf_counter()
                results = await again.run_many(sb, commands)
                rep_s = time.perf_counter() - t
                lines_after = int((await sb.run_shell(f"wc -l < {COUNTER}")).stdout)
                assert again.replayed == steps and again.executed == 0
                assert lines_after == steps, "a replayed step ran"
                assert len(results) == steps
                out["replay"] = {
                    "seconds": round(rep_s, 3),
                    "steps_per_s": round(steps / rep_s),
                    "replayed": again.replayed,
                    "executions": lines_after - lines,
                    "counter_lines_before": lines,
                    "counter_lines_after": lines_after,
                }

                # 3. per-step latency: plain commands vs logged steps vs single replays
                samples: dict[str, list[float]] = {
                    k: []
                    for k in ("plain_run_shell", "plain_api_exec", "traj_step", "traj_api_exec")
                }
                # (a sandbox serves one trajectory: one more for each logged kind)
                sb2 = await client.run_container(args)
                sb3 = await client.run_container(args)
                single = client.trajectory("bench", "single")
                replay_single: list[float] = []
                for i in range(latency_n):
                    t = time.perf_counter()
                    await sb.run_shell("true")
                    samples["plain_run_shell"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    await client._send(_exec(sb.id, ExecRequest(command="true")))
                    samples["plain_api_exec"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    await single.run_shell(sb2, "true")
                    samples["traj_step"].append(time.perf_counter() - t)
                    ref = TrajectoryRef(job_id="bench", rollout_id="api2", step=i)
                    t = time.perf_counter()
                    await client._send(_exec(sb3.id, ExecRequest(command="true", trajectory=ref)))
                    samples["traj_api_exec"].append(time.perf_counter() - t)
                resumed = client.trajectory("bench", "rollout")
                for c in commands[:latency_n]:
                    t = time.perf_counter()
                    await resumed.run_shell(sb, c)
                    replay_single.append(time.perf_counter() - t)
                assert resumed.executed == 0
                await sb2.stop()
                await sb3.stop()
                out["latency"] = {k: stats(v) for k, v in samples.items()}
                out["latency"]["replay_single_step"] = stats(replay_single)
                final = int((await sb.run_shell(f"wc -l < {COUNTER}")).stdout)
                assert final == steps
    out["in_process"] = log_cost()
    return out


def _exec(sandbox_id: str, req: ExecRequest) -> Any:
    from dsec.sdk import _protocol as proto

    call = proto.exec_command(sandbox_id, "true")
    return type(call)(
        call.method,
        call.path,
        call.parse,
        content=req.model_dump_json(exclude_defaults=True).encode(),
        headers=call.headers,
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--latency-n", type=int, default=300)
    ns = ap.parse_args()
    result = asyncio.run(main(ns.steps, ns.latency_n))
    text = json.dumps(result, indent=2)
    print(text)
    (REPO / "bench" / "results" / "replay.json").write_text(text + "\n")
