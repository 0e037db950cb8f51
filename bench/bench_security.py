"""Cost of the hardening (issue 5), in one run, side by side.

    .venv/bin/python bench/bench_security.py [--n 60]

Two platforms run at once on this host, one with the seccomp profile off
(``DSEC_SECCOMP=0``) and one with it on (the default). Their requests are interleaved
(seccomp off/on x egress rules none/{"pypi": True}, rotating), so that host noise hits
every configuration alike. Per configuration: create latency, and exec latency of
``true`` on that sandbox. On the seccomp-on platform: ``update_network`` round trips
(the rules apply when the call returns: one atomic nftables batch). In process
(dsec.net.manager): what a create with rules and an update cost inside the edge.
No traffic leaves the host (the catalog's pypi points at a static, unused address).

Targets: rules add <= 5 ms to create and nothing measurable to exec; an update
applies in <= 10 ms. Writes bench/results/security.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecContainerRunArgs, DSecSyncClient  # noqa: E402
from dsec.net.manager import NetworkManager  # noqa: E402

EXECS_PER_SANDBOX = 10


def stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], 3),
    }


async def in_process(n: int) -> dict[str, dict[str, float]]:
    """The edge's own cost: a pool slot + one nft batch per create, one batch per update."""
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bsec-"))
    m = NetworkManager(edge_id="bsec" + str(int(time.time()) % 100000), run_dir=run_dir)
    await m.start()
    attach: list[float] = []
    update: list[float] = []
    try:
        await asyncio.sleep(0.5)
        for i in range(n):
            t = time.perf_counter()
            await m.attach(f"s{i}", {"pypi": True, "10.0.0.0/8:443": True})
            attach.append(time.perf_counter() - t)
            m.joined(f"s{i}")
            for rules in ({}, {"pypi": True}):
                t = time.perf_counter()
                await m.update(f"s{i}", rules)
                update.append(time.perf_counter() - t)
            m.release(f"s{i}")
            await asyncio.sleep(0.05)  # let the pool refill, as between real creates
    finally:
        await m.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"create_network_attach": stats(attach), "update_network": stats(update)}


def end_to_end(n: int) -> dict[str, dict[str, float]]:
    pypi = {"hosts": ["pypi.org"], "ports": [443], "addresses": {"pypi.org": ["198.19.255.2"]}}
    samples: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        catalog = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".json"))
        json.dump({"services": {"pypi": pypi}}, catalog)
        catalog.flush()
        clients = {}
        for name, seccomp in (("seccomp_off", "0"), ("seccomp_on", "1")):
            plat = stack.enter_context(
                platform_process(DSEC_NETWORK_CATALOG=catalog.name, DSEC_SECCOMP=seccomp)
            )
            client = stack.enter_context(DSecSyncClient(plat.url, plat.api_key))
            client.build_image("busybox")
            clients[name] = client
        configs = [
            (platform, label, rules)
            for platform in clients
            for label, rules in (("no_rules", {}), ("rules", {"pypi": True}))
        ]
        for i in range(n + 3):
            for k in range(len(configs)):
                platform, label, rules = configs[(i + k) % len(configs)]  # rotate the order
                client = clients[platform]
                key = f"{platform}/{label}"
                spec = DSecContainerRunArgs(
                    container_image="busybox:latest", network_rules=rules, memory_limit_mb=64
                )
                t = time.perf_counter()
                sb = client.run_container(spec)
                elapsed = time.perf_counter() - t
                warm = i >= 3  # the first rounds warm caches, pools and connections
                if warm:
                    samples.setdefault(f"create/{key}", []).append(elapsed)
                for _ in range(EXECS_PER_SANDBOX):
                    t = time.perf_counter()
                    sb.exec(["true"])
                    if warm:
                        samples.setdefault(f"exec/{key}", []).append(time.perf_counter() - t)
                if rules and platform == "seccomp_on":
                    for new in ({}, {"pypi": True}):
                        t = time.perf_counter()
                        sb.update_network(new)
                        if warm:
                            samples.setdefault("update_network/sdk_round_trip", []).append(
                                time.perf_counter() - t
                            )
                sb.stop()
    return {k: stats(v) for k, v in sorted(samples.items())}


def deltas(e2e: dict[str, dict[str, float]]) -> dict[str, float]:
    def p50(key: str) -> float:
        return e2e[key]["p50_ms"]

    return {
        "rules_add_to_create_ms": round(
            p50("create/seccomp_on/rules") - p50("create/seccomp_on/no_rules"), 3
        ),
        "seccomp_adds_to_create_ms": round(
            p50("create/seccomp_on/no_rules") - p50("create/seccomp_off/no_rules"), 3
        ),
        "rules_add_to_exec_ms": round(
            p50("exec/seccomp_on/rules") - p50("exec/seccomp_on/no_rules"), 3
        ),
        "seccomp_adds_to_exec_ms": round(
            p50("exec/seccomp_on/no_rules") - p50("exec/seccomp_off/no_rules"), 3
        ),
        "update_network_p50_ms": p50("update_network/sdk_round_trip"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60, help="sandboxes per configuration")
    n = ap.parse_args().n
    result: dict[str, Any] = {"in_process": asyncio.run(in_process(n))}
    result["end_to_end"] = end_to_end(n)
    result["summary"] = deltas(result["end_to_end"])
    out = REPO / "bench" / "results" / "security.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measure':44} {'p50 ms':>9} {'p99 ms':>9} {'n':>5}")
    for section in ("in_process", "end_to_end"):
        for key, s in result[section].items():
            print(f"{key:44} {s['p50_ms']:9.3f} {s['p99_ms']:9.3f} {s['n']:5d}")
    print("summary:", json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
