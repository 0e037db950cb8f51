"""FnCall backend benchmark (issue 7), one run, side by side with the container baseline.

    .venv/bin/python bench/bench_fncall.py [--n 300] [--judges 100] [--overlay] [--quick]

A real platform (`dsec up` in a fresh data dir). Measures, client side (the SDK's FnCall
WebSocket; ``warm_bash_http`` is the same over the HTTP route, for comparison):
warm ``run_code`` latency (bash ``echo 1``, python ``print(1)``, busybox sh), calls/s
at saturation, a pool's warm-up to 32 ready sandboxes, the first call on a cold pool
against a warm one, 1,000 judge runs of a small C++ program (100 judges x 10 tests,
and one judge of 1,000 tests),
and the baseline: ``run_container`` + ``run_shell`` + ``stop`` per call. ``--overlay``
repeats the warm latencies with a writable overlay per sandbox (DSEC_FNCALL_ROOT=overlay)
instead of the shared read-only root; the saturation run is repeated with a network
namespace per call (``loopback=True``). Writes bench/results/fncall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient  # noqa: E402
from dsec.api.fncall import DSecFnCallRunArgs  # noqa: E402
from dsec.fncall.toolchain import TOOLCHAIN_REF, ensure_toolchain_tree  # noqa: E402

CPP = """#include <iostream>
int main(){ long a, b; std::cin >> a >> b; std::cout << a + b << "\\n"; }
"""


def summary(samples_s: list[float]) -> dict[str, float]:
    s = sorted(samples_s)
    return {
        "n": len(s),
        "p50_ms": round(statistics.median(s) * 1e3, 2),
        "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 2),
    }


async def sequential(
    client: DSecClient, args: DSecFnCallRunArgs, code: str, n: int
) -> dict[str, Any]:
    for _ in range(5):
        await client.run_code(args, code)
    total, edge, wall = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        r = await client.run_code(args, code)
        total.append(time.perf_counter() - t)
        assert r.status == "ok", r
        edge.append(r.latency_s)
        wall.append(r.wall_time_s)
    return {"client": summary(total), "edge": summary(edge), "in_sandbox": summary(wall)}


def _cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / tck, (int(f[13]) + int(f[14])) / tck


def cpu_snapshot(platform_pid: int) -> dict[str, float]:
    """CPU used so far by the platform, its zygotes and their (reaped) sandboxes."""
    own, _ = _cpu_s(platform_pid)
    zyg = sandboxes = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv0 = fh.read().split(b"\0")[0]
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if b"dsec-zygote" in argv0 and ppid == platform_pid:
                z, c = _cpu_s(int(entry))
                zyg += z
                sandboxes += c
        except (OSError, ValueError):
            continue
    t = os.times()
    return {"platform": own, "zygotes": zyg, "sandboxes": sandboxes, "client": t.user + t.system}


async def saturation(
    client: DSecClient,
    args: DSecFnCallRunArgs,
    code: str,
    seconds: float,
    width: int,
    platform_pid: int | None = None,
) -> dict[str, Any]:
    await client.warm_pool(args, width)
    before = cpu_snapshot(platform_pid) if platform_pid else {}
    done = 0
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            t = time.perf_counter()
            r = await client.run_code(args, code)
            lat.append(time.perf_counter() - t)
            assert r.status == "ok", r
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(width)))
    dt = time.perf_counter() - t0
    out: dict[str, Any] = {
        "calls": done,
        "seconds": round(dt, 2),
        "calls_per_s": round(done / dt, 1),
        "concurrency": width,
        **summary(lat),
    }
    if platform_pid:
        # Where the CPU goes, per call (a zygote's still-running sandboxes are missed).
        after = cpu_snapshot(platform_pid)
        out["cpu_ms_per_call"] = {k: round((after[k] - before[k]) / done * 1e3, 2) for k in after}
    return out


async def baseline(client: DSecClient, n: int, width: int) -> dict[str, Any]:
    args = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)

    async def one() -> float:
        t = time.perf_counter()
        sb = await client.run_container(args, timeout=120)
        r = await sb.run_shell("echo 1")
        assert r.exit_code == 0
        await sb.stop()
        return time.perf_counter() - t

    for _ in range(3):
        await one()
    seq = [await one() for _ in range(n)]
    sem = asyncio.Semaphore(width)

    async def limited() -> float:
        async with sem:
            return await one()

    t0 = time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(n)))
    dt = time.perf_counter() - t0
    return {"sequential": summary(seq), "calls_per_s": round(n / dt, 1), "concurrency": width}


async def cold_vs_warm(client: DSecClient, base: DSecFnCallRunArgs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, mem in enumerate((40, 41, 42)):  # each a new pool: zygote start + first sandbox
        args = base.model_copy(update={"memory_limit_mb": mem})
        t = time.perf_counter()
        r = await client.run_code(args, "echo 1")
        out.setdefault("cold_ms", []).append(round((time.perf_counter() - t) * 1e3, 2))
        assert r.status == "ok" and not r.warm, r
        del i
    t = time.perf_counter()
    info = await client.warm_pool(base.model_copy(update={"memory_limit_mb": 43}), 32)
    out["warm_to_32_s"] = round(time.perf_counter() - t, 3)
    out["warm_to_32_server_s"] = info.warm_s
    assert info.ready >= 32, info
    info = await client.warm_pool(base.model_copy(update={"memory_limit_mb": 43}), 64)
    out["existing_pool_32_to_64_s"] = info.warm_s
    return out


async def judges(client: DSecClient, n: int) -> dict[str, Any]:
    args = DSecFnCallRunArgs(image=TOOLCHAIN_REF, language="cpp", timeout_s=2, memory_limit_mb=128)
    tests = [(f"{i} {i * 7}", str(i * 8)) for i in range(10)]
    per_test: list[float] = []
    compile_s: list[float] = []
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(4)

    async def one() -> None:
        async with sem:
            j = await client.judge(args, CPP, tests)
        assert j.verdict == "AC", j
        assert j.compile is not None
        compile_s.append(j.compile.wall_time_s)
        per_test.extend(t.wall_time_s for t in j.tests)

    await asyncio.gather(*(one() for _ in range(n)))
    dt = time.perf_counter() - t0
    return {
        "judges": n,
        "runs": n * len(tests),
        "seconds": round(dt, 1),
        "runs_per_s_incl_compile": round(n * len(tests) / dt, 1),
        "compile": summary(compile_s),
        "test_run_in_sandbox": summary(per_test),
    }


async def judge_many_tests(client: DSecClient, n: int) -> dict[str, Any]:
    """One judge, ``n`` tests: one compile, then ``n`` runs, each in a fresh sandbox."""
    args = DSecFnCallRunArgs(image=TOOLCHAIN_REF, language="cpp", timeout_s=2, memory_limit_mb=128)
    tests = [(f"{i} {i * 7}", str(i * 8)) for i in range(n)]
    t0 = time.perf_counter()
    j = await client.judge(args, CPP, tests)
    dt = time.perf_counter() - t0
    assert j.verdict == "AC" and j.compile is not None, j
    run_s = dt - j.compile.wall_time_s
    return {
        "tests": n,
        "seconds": round(dt, 2),
        "compile_s": round(j.compile.wall_time_s, 2),
        "runs_per_s_after_compile": round(n / run_s, 1),
        "test_run_in_sandbox": summary([t.wall_time_s for t in j.tests]),
    }


async def bench(url: str, key: str, ns: argparse.Namespace, pid: int) -> dict[str, Any]:
    client = DSecClient(url, key, max_connections=512)
    await client.open()
    try:
        bb = DSecFnCallRunArgs(image="busybox:latest", language="sh", memory_limit_mb=64)
        tc = DSecFnCallRunArgs(image=TOOLCHAIN_REF, language="bash", memory_limit_mb=256)
        py = tc.model_copy(update={"language": "python"})
        res: dict[str, Any] = {"host_cpus": os.cpu_count()}
        if not ns.quick:
            res["pool_cold_vs_warm"] = await cold_vs_warm(client, bb)
            print("cold/warm pool", res["pool_cold_vs_warm"], flush=True)
        res["warm_bash"] = await sequential(client, tc, "echo 1", ns.n)
        print("warm bash", res["warm_bash"], flush=True)
        http = DSecClient(url, key)
        http._fncall_http_only = True  # what every call paid before the WebSocket
        try:
            res["warm_bash_http"] = await sequential(http, tc, "echo 1", ns.n)
        finally:
            await http.close()
        print("warm bash over HTTP", res["warm_bash_http"], flush=True)
        res["warm_python"] = await sequential(client, py, "print(1)", ns.n)
        print("warm python", res["warm_python"], flush=True)
        res["warm_busybox_sh"] = await sequential(client, bb, "echo 1", ns.n)
        print("warm sh", res["warm_busybox_sh"], flush=True)
        if ns.quick:
            return res
        res["saturation_bash"] = await saturation(client, tc, "echo 1", ns.seconds, 32, pid)
        print("saturation bash", res["saturation_bash"], flush=True)
        res["saturation_busybox_sh"] = await saturation(client, bb, "echo 1", ns.seconds, 32, pid)
        print("saturation sh", res["saturation_busybox_sh"], flush=True)
        per_call = bb.model_copy(update={"loopback": True})  # a network namespace per call
        res["saturation_busybox_sh_netns_per_call"] = await saturation(
            client, per_call, "echo 1", ns.seconds, 32, pid
        )
        print("saturation sh, netns per call", res["saturation_busybox_sh_netns_per_call"])
        if ns.judges:
            res["judge_cpp"] = await judges(client, ns.judges)
            print("judge", res["judge_cpp"], flush=True)
            res["judge_cpp_1000_tests"] = await judge_many_tests(client, 1000)
            print("judge, 1000 tests", res["judge_cpp_1000_tests"], flush=True)
        res["baseline_container"] = await baseline(client, ns.baseline, 8)
        print("baseline", res["baseline_container"], flush=True)
        return res
    finally:
        await client.close()


async def overlay_mode(url: str, key: str, n: int) -> dict[str, Any]:
    client = DSecClient(url, key)
    await client.open()
    try:
        tc = DSecFnCallRunArgs(image=TOOLCHAIN_REF, language="bash", memory_limit_mb=256)
        return {
            "warm_bash": await sequential(client, tc, "echo 1", n),
            "warm_python": await sequential(
                client, tc.model_copy(update={"language": "python"}), "print(1)", n
            ),
        }
    finally:
        await client.close()


def prepare(url: str, key: str, tree: Path) -> None:
    with DSecSyncClient(url, key, timeout=600) as c:
        c.build_image("busybox")
        c.import_image(TOOLCHAIN_REF, tree, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="sequential calls per language")
    ap.add_argument("--seconds", type=float, default=5.0, help="saturation run length")
    ap.add_argument("--judges", type=int, default=100, help="judges of 10 tests each")
    ap.add_argument("--baseline", type=int, default=100, help="container baseline calls")
    ap.add_argument("--overlay", action="store_true", help="also measure overlay mode")
    ap.add_argument(
        "--quick", action="store_true", help="warm latencies only (printed, no results file)"
    )
    ns = ap.parse_args()
    tree = asyncio.run(ensure_toolchain_tree())
    result: dict[str, Any] = {}
    with open("/proc/loadavg") as fh:
        result["loadavg_before"] = fh.read().split()[:3]
    with platform_process(DSEC_FNCALL_MAX_READY="128") as plat:
        prepare(plat.url, plat.api_key, tree)
        assert plat.proc is not None
        result["shared_root"] = asyncio.run(bench(plat.url, plat.api_key, ns, plat.proc.pid))
    if ns.overlay:
        with platform_process(DSEC_FNCALL_ROOT="overlay") as plat:
            prepare(plat.url, plat.api_key, tree)
            result["overlay_root"] = asyncio.run(overlay_mode(plat.url, plat.api_key, ns.n))
            print("overlay", result["overlay_root"], flush=True)
    with open("/proc/loadavg") as fh:
        result["loadavg_after"] = fh.read().split()[:3]
    if ns.quick:
        print(json.dumps(result, indent=2))
        return
    out = REPO / "bench" / "results" / "fncall.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
