"""Hosted rollouts through a trainer outage (issue 20, DSEC.md §6.2, §6.3).

    .venv/bin/python bench/bench_rollouts.py [--n 100] [--outage 30] [--steps 4]
        [--pause-after 5] [--probe-calls 200]

On a real platform (`dsec up` in a subprocess, fresh data dir) and a scripted
OpenAI-compatible trainer on the host (tests/scripted_trainer.py):

1. Gateway latency: a static C probe (bench/rollout_probe.c, built here) in an agent
   sandbox alternates calls to the model gateway and to the trainer directly (the
   sandbox is allowed to reach the host), one new connection each, interleaved; the
   gateway's added latency is the difference of the medians (and p99s).
2. Outage: ``n`` rollouts of one job (busybox scaffolds, ``steps`` model calls each)
   start; once each had a call answered the trainer is stopped for ``outage`` seconds;
   the rollouts wait, then pause (sandboxes frozen, memory reclaimed: the job's
   sandbox memory from /v1/stats before and during the outage); a new trainer on
   another port comes up, the job is pointed at it, and every rollout must finish with
   each step's call answered exactly once across both trainers (the first trainer answers
   each rollout's first call and holds the second, which it drops unanswered when it
   dies: every rollout is mid-call at the outage).

Writes bench/results/rollouts.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402
from tests.scripted_trainer import ScriptedTrainer  # noqa: E402

from bench.probes import static_binary  # noqa: E402
from dsec import (  # noqa: E402
    DSecContainerRunArgs,
    DSecSyncClient,
    ModelEndpoint,
    RolloutSpec,
    RolloutState,
)

MiB = 1024 * 1024


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def scaffold(steps: int, heap_mib: int = 0) -> str:
    """A busybox agent loop of ``steps`` model calls; ``heap_mib`` of state held in
    /dev/shm first (random bytes: shmem, reclaimable only by swapping it out), as a
    real scaffold holds its context, so that a pause has something to give back."""
    call = (
        'wget -q -O - --header "Authorization: Bearer $OPENAI_API_KEY" '
        "--header 'Content-Type: application/json' "
        '--post-data "{\\"model\\":\\"x\\",\\"messages\\":[{\\"role\\":\\"user\\",'
        '\\"content\\":\\"$DSEC_ROLLOUT_ID step $i\\"}]}" "$OPENAI_BASE_URL/chat/completions"'
    )
    heap = (
        f"dd if=/dev/urandom of=/dev/shm/heap bs=1M count={heap_mib} 2>/dev/null; "
        if heap_mib
        else ""
    )
    return (
        heap + f"i=0; while [ $i -lt {steps} ]; do "
        f"until out=$({call} 2>/dev/null); do sleep 0.5; done; "
        'echo "$i" >> /tmp/steps; i=$((i+1)); sleep 0.5; done'
    )


def latency(
    client: DSecSyncClient, trainer: ScriptedTrainer, probe: bytes, calls: int
) -> dict[str, float]:
    job = "bench-probe"
    ro = client.start_rollout(
        RolloutSpec(
            job_id=job,
            sandbox=DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=64, network_rules={"host": True}
            ),
            scaffold='echo "$OPENAI_API_KEY $OPENAI_BASE_URL" > /tmp/gw; sleep 3600',
            model=ModelEndpoint(base_url=trainer.url),
            timeout=3600,
        )
    )
    deadline = time.monotonic() + 120
    while True:
        info = client.get_rollout(ro.id)
        if info.sandbox_id is not None and info.state is RolloutState.RUNNING:
            sb = client.get(info.sandbox_id)
            if sb.run_shell("cat /tmp/gw").exit_code == 0:
                break
        if time.monotonic() > deadline:
            raise RuntimeError("probe rollout did not start")
        time.sleep(0.2)
    token, base = sb.read_file("/tmp/gw").decode().split()
    gw_ip, gw_port = base.split("/")[2].split(":")
    sb.write_file("/tmp/probe", probe, mode=0o755)
    res = sb.run_shell(
        f"/tmp/probe {calls} {gw_ip} {gw_port} {token} {gw_ip} {trainer.port} none", timeout=600
    )
    samples: dict[str, list[float]] = {"gateway": [], "direct": []}
    for line in res.stdout.splitlines():
        kind, us = line.split()
        if int(us) >= 0:
            samples[kind].append(int(us) / 1000)
    client.cancel_rollout(ro.id)
    inside = [
        (s.result["handled"] - s.result["latency"]) * 1000
        for r in client.finished_rollouts(job)
        for s in r.steps
        if s.op == "model_call" and s.result is not None
    ]
    client.ack_rollouts(job, [ro.id])
    g, d = samples["gateway"], samples["direct"]
    return {
        "calls": min(len(g), len(d)),
        "gateway_p50_ms": round(statistics.median(g), 3),
        "gateway_p99_ms": round(pct(g, 0.99), 3),
        "direct_p50_ms": round(statistics.median(d), 3),
        "direct_p99_ms": round(pct(d, 0.99), 3),
        "added_p50_ms": round(statistics.median(g) - statistics.median(d), 3),
        "added_p99_ms": round(pct(g, 0.99) - pct(d, 0.99), 3),
        "in_gateway_p50_ms": round(statistics.median(inside), 3),
        "in_gateway_p99_ms": round(pct(inside, 0.99), 3),
    }


def job_memory(client: DSecSyncClient, job: str) -> int:
    return sum(s.memory_bytes or 0 for s in client.stats() if s.job_id == job)


def outage(
    client: DSecSyncClient,
    n: int,
    steps: int,
    seconds: float,
    pause_after: float,
    heap_mib: int = 16,
) -> dict[str, object]:
    job = "bench-outage"
    # Step 0 of each rollout is answered; its step 1 is in flight at the trainer when
    # it dies (dropped unanswered), so every rollout is mid-call at the outage.
    first = ScriptedTrainer(hold_after_first=True).start()
    second: ScriptedTrainer | None = None
    try:
        t0 = time.monotonic()
        ids = [
            client.start_rollout(
                RolloutSpec(
                    job_id=job,
                    sandbox=DSecContainerRunArgs(
                        container_image="busybox:latest", memory_limit_mb=64
                    ),
                    scaffold=scaffold(steps, heap_mib),
                    model=ModelEndpoint(base_url=first.url),
                    timeout=1800,
                    pause_after=pause_after,
                )
            ).id
            for _ in range(n)
        ]
        while not all(r.model_calls >= 1 for r in client.list_rollouts(job)):
            time.sleep(0.5)
        started = time.monotonic() - t0
        mem_before = job_memory(client, job)
        first.stop()
        down = time.monotonic()
        while not all(r.state is RolloutState.PAUSED for r in client.list_rollouts(job)):
            if time.monotonic() - down > seconds + 60:
                raise RuntimeError("rollouts did not all pause")
            time.sleep(0.5)
        all_paused = time.monotonic() - down
        mem_during = job_memory(client, job)
        time.sleep(max(0.0, seconds - (time.monotonic() - down)))
        second = ScriptedTrainer().start()
        client.set_model_endpoint(job, ModelEndpoint(base_url=second.url))
        back = time.monotonic()
        finals = [client.wait_rollout(i, timeout=1800) for i in ids]
        recovered = time.monotonic() - back
        seen = collections.Counter(first.answered + second.answered)
        expected = {f"{i} step {s}" for i in ids for s in range(steps)}
        results = client.finished_rollouts(job, limit=10_000)
        recorded = sum(
            1 for r in results for s in r.steps if s.op == "model_call" and s.status == "ok"
        )
        client.ack_rollouts(job, ids)
        return {
            "rollouts": n,
            "steps_each": steps,
            "outage_s": seconds,
            "finished": sum(1 for f in finals if f.state is RolloutState.FINISHED),
            "states": dict(collections.Counter(f.state.value for f in finals)),
            "calls_lost": len([p for p in expected if seen[p] == 0]),
            "calls_answered_twice": len([p for p in expected if seen[p] > 1]),
            "calls_dropped_by_the_dying_trainer": len(first.prompts()) - len(first.answered),
            "model_call_steps": recorded,
            "retries": sum(f.model_retries for f in finals),
            "start_to_first_calls_s": round(started, 2),
            "outage_to_all_paused_s": round(all_paused, 2),
            "back_to_all_finished_s": round(recovered, 2),
            "job_memory_before_mib": round(mem_before / MiB, 1),
            "job_memory_during_outage_mib": round(mem_during / MiB, 1),
        }
    finally:
        first.stop()
        if second is not None:
            second.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pause-after", type=float, default=5.0)
    ap.add_argument("--probe-calls", type=int, default=200)
    ap.add_argument("--heap-mib", type=int, default=16, help="state each scaffold holds")
    args = ap.parse_args()
    out: dict[str, object] = {
        "args": vars(args),
        "load": Path("/proc/loadavg").read_text().split()[:3],
    }
    with tempfile.TemporaryDirectory() as tmp, platform_process() as plat:
        probe = static_binary("rollout_probe.c", Path(tmp))
        with DSecSyncClient(plat.url, plat.api_key, timeout=300) as client:
            client.build_image("busybox")
            direct = ScriptedTrainer(host="0.0.0.0").start()
            try:
                out["latency"] = latency(client, direct, probe, args.probe_calls)
            finally:
                direct.stop()
            print(json.dumps(out["latency"], indent=2), flush=True)
            out["outage"] = outage(
                client, args.n, args.steps, args.outage, args.pause_after, args.heap_mib
            )
            print(json.dumps(out["outage"], indent=2), flush=True)
    res = REPO / "bench" / "results"
    res.mkdir(exist_ok=True)
    (res / "rollouts.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
