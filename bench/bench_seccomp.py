"""Cost of the seccomp profile (issue 5), one run, three platforms side by side.

    .venv/bin/python bench/bench_seccomp.py [--creates 100] [--execs 300]

Modes: ``off`` (DSEC_SECCOMP=0), ``kernel`` (the profile, dangerous calls refused in
the kernel alone: DSEC_SECCOMP_NOTIFY=0) and ``notify`` (the default: dangerous calls
answered and recorded by the edge), measured in interleaved rounds. Measures through
the SDK: create latency, ``run_shell("true")`` latency, and a syscall-heavy command
(busybox dd with 1-byte blocks: ~400k read/write calls, CPU time) for the per-call cost of the
filter.
Writes bench/results/seccomp.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.bench_platform import exec_latency, summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402

MODES = {
    "off": {"DSEC_SECCOMP": "0"},
    "kernel": {"DSEC_SECCOMP_NOTIFY": "0"},
    "notify": {},
}
SPEC = DSecContainerRunArgs(
    container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
)
# busybox `time` prints user and sys CPU seconds: steadier than wall time on a busy host.
DD = 'time sh -c "dd if=/dev/zero of=/dev/null bs=1 count=200000 2>/dev/null"'


def cpu_seconds(stderr: str) -> float:
    fields = {line.split()[0]: line.split()[-1] for line in stderr.strip().splitlines()}
    return sum(float(fields[k].rstrip("s")) for k in ("user", "sys"))


async def run(opts: argparse.Namespace, plats: dict[str, Any]) -> dict[str, Any]:
    """Interleaved: each round measures every mode, so load from anything else on the
    host falls on all three alike."""
    clients = {m: DSecClient(p.url, p.api_key, timeout=300) for m, p in plats.items()}
    samples: dict[str, dict[str, list[float]]] = {
        m: {"create": [], "exec": [], "dd_400k_syscalls_cpu": []} for m in plats
    }
    ones: dict[str, Any] = {}
    try:
        for m, client in clients.items():
            await client.open()
            await client.build_image("busybox")
            for _ in range(10):
                await (await client.run_container(SPEC)).stop()
            ones[m] = await client.run_container(SPEC)
            await exec_latency(ones[m], 0)
        rounds = max(1, opts.creates // 10)
        for _ in range(rounds):
            for m, client in clients.items():
                for _ in range(10):
                    t = time.perf_counter()
                    sb = await client.run_container(SPEC)
                    samples[m]["create"].append(time.perf_counter() - t)
                    await sb.stop()
                for _ in range(opts.execs // rounds):
                    t = time.perf_counter()
                    await ones[m].run_shell("true")
                    samples[m]["exec"].append(time.perf_counter() - t)
                r = await ones[m].run_shell(DD)
                assert r.exit_code == 0, r
                samples[m]["dd_400k_syscalls_cpu"].append(cpu_seconds(r.stderr))
        for sb in ones.values():
            await sb.stop()
    finally:
        for client in clients.values():
            await client.close()
    return {m: {k: summary(v) for k, v in d.items()} for m, d in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--creates", type=int, default=100)
    ap.add_argument("--execs", type=int, default=300)
    opts = ap.parse_args()
    with contextlib.ExitStack() as stack:
        plats = {m: stack.enter_context(platform_process(**env)) for m, env in MODES.items()}
        results: dict[str, Any] = asyncio.run(run(opts, plats))
    results["host"] = {"cpus": os.cpu_count(), "kernel": os.uname().release}
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "seccomp.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'measure':34} " + " ".join(f"{m:>16}" for m in MODES))
    for key, label in (
        ("create", "create p50 / p99 ms"),
        ("exec", "run_shell('true') p50 / p99 ms"),
        ("dd_400k_syscalls_cpu", "dd 400k syscalls CPU p50 / p99 ms"),
    ):
        cells = [
            f"{results[m][key]['p50_ms']:7.2f} / {results[m][key]['p99_ms']:6.2f}" for m in MODES
        ]
        print(f"{label:34} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
