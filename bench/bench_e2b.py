"""What the E2B compatibility layer costs (issue 16): E2B SDK vs our SDK, one run.

    .venv/bin/python bench/bench_e2b.py [--creates 40] [--execs 300]

Starts its own `dsec up`, then measures, interleaved so both see the same host load:
sandbox create (E2B ``Sandbox.create`` -> /v2/sandboxes + the default-user setup; ours
``run_container``), and a trivial command (E2B ``commands.run("true")``, a Connect
server stream over HTTP/1.1; ours ``run_shell("true")`` over the multiplexed data-path
WebSocket). Both use the sync clients. Prints p50/p99 and E2B/ours ratios and writes
bench/results/e2b.json.
"""

from __future__ import annotations

import argparse
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

from bench.bench_platform import loadavg, summary  # noqa: E402
from dsec import DSecContainerRunArgs, DSecSyncClient  # noqa: E402


def run(opts: argparse.Namespace, url: str, key: str) -> dict[str, Any]:
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
    from e2b import Sandbox

    res: dict[str, Any] = {}
    with DSecSyncClient(url, key, timeout=300) as client:
        image = client.build_image("busybox")
        ref = f"{image.name}:{image.tag}"
        args = DSecContainerRunArgs(container_image=ref, ttl_running_stop=300)
        e2b_create: list[float] = []
        our_create: list[float] = []
        for i in range(opts.creates):
            for which in ("e2b", "ours") if i % 2 == 0 else ("ours", "e2b"):
                t = time.perf_counter()
                if which == "e2b":
                    Sandbox.create(ref, timeout=300).kill()
                    e2b_create.append(time.perf_counter() - t)
                else:
                    client.run_container(args).stop()
                    our_create.append(time.perf_counter() - t)
        res["create_and_kill_e2b"] = summary(e2b_create)
        res["create_and_kill_ours"] = summary(our_create)

        e2b_box = Sandbox.create(ref, timeout=300)
        ours = client.run_container(args)
        try:
            for _ in range(20):  # warm connections and agents
                e2b_box.commands.run("true")
                ours.run_shell("true")
            e2b_exec: list[float] = []
            our_exec: list[float] = []
            for _ in range(opts.execs):
                t = time.perf_counter()
                e2b_box.commands.run("true")
                e2b_exec.append(time.perf_counter() - t)
                t = time.perf_counter()
                ours.run_shell("true")
                our_exec.append(time.perf_counter() - t)
        finally:
            e2b_box.kill()
            ours.stop()
        res["run_true_e2b"] = summary(e2b_exec)
        res["run_true_ours"] = summary(our_exec)
    for what in ("create_and_kill", "run_true"):
        for q in ("p50_ms", "p99_ms"):
            res[f"ratio_{what}_{q[:3]}_e2b_over_ours"] = (
                res[f"{what}_e2b"][q] / res[f"{what}_ours"][q]
            )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--creates", type=int, default=40)
    ap.add_argument("--execs", type=int, default=300)
    opts = ap.parse_args()
    load_start = loadavg()
    with platform_process() as plat:
        res = run(opts, plat.url, plat.api_key)
    res["host"] = {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": loadavg()}
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "e2b.json").write_text(json.dumps(res, indent=2))
    print(f"\n{'measure':40} {'n':>5} {'p50 ms':>9} {'p99 ms':>9}")
    for name in ("create_and_kill_e2b", "create_and_kill_ours", "run_true_e2b", "run_true_ours"):
        s = res[name]
        print(f"{name:40} {s['n']:>5} {s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f}")
    for name, value in res.items():
        if name.startswith("ratio_"):
            print(f"{name:40} {value:>25.2f}")


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
