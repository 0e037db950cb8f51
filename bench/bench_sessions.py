"""Data-path benchmark (issue 3): commands, sessions, streaming and files, one run.

    .venv/bin/python bench/bench_sessions.py [--execs 500] [--idle 1000]

Starts its own `dsec up`, then measures through the SDK (direct data path, one
multiplexed WebSocket): `run_shell("true")` and session `run("true")` latency with 1,
100 and N idle sandboxes on the host; time to the first streamed byte; a 1 MiB write +
read round trip; 100 MiB upload throughput (one file, and a directory as a tar stream).
Baselines in the same run, into the same sandbox: `crun exec`, `nsenter`, the agent's
own round trip, and the older HTTP exec route. Prints a table, writes
bench/results/sessions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from dsec import DSecClient, DSecContainerRunArgs, Sandbox  # noqa: E402
from dsec.agent.build import agent_binary  # noqa: E402
from dsec.resources import cgroups  # noqa: E402
from dsec.sessions.agent_client import AgentClient  # noqa: E402

MiB = 1 << 20


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99)}


async def timed(fn: Callable[[], Awaitable[object]], n: int, warm: int = 30) -> dict[str, float]:
    for _ in range(warm):
        await fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return summary(out)


def spawn_wait(argv: list[str]) -> None:
    """posix_spawn + wait: the cheapest way to start a baseline tool from Python."""
    pid = os.posix_spawn(argv[0], argv, os.environ)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} failed with {status}")


def timed_sync(argv: list[str], n: int, warm: int = 10) -> dict[str, float]:
    for _ in range(warm):
        spawn_wait(argv)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        spawn_wait(argv)
        out.append(time.perf_counter() - t)
    return summary(out)


def docker_status() -> str:
    docker = shutil.which("docker")
    if docker is None:
        return "not runnable on this machine: no docker binary (and no dockerd)"
    probe = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return "not runnable on this machine: dockerd is not running"
    return "available but not measured (needs dockerd without iptables; see HOST_LIMITS.md)"


def mem_used_bytes() -> int:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, val = line.split(":", 1)
            info[key] = int(val.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


async def latencies(sb: Sandbox, n: int) -> dict[str, dict[str, float]]:
    sess = await sb.session()
    out = {
        "run_shell": await timed(lambda: sb.run_shell("true"), n),
        "session_run": await timed(lambda: sess.run("true"), n),
    }
    await sess.close()
    return out


async def first_byte(sb: Sandbox, n: int) -> dict[str, float]:
    samples = []
    for i in range(n + 10):
        t = time.perf_counter()
        stream = sb.stream("printf x; sleep 5")
        await anext(stream)
        if i >= 10:
            samples.append(time.perf_counter() - t)
        await stream.aclose()
    return summary(samples)


async def files(sb: Sandbox, tmp: Path) -> dict[str, Any]:
    blob = os.urandom(MiB)

    async def round_trip() -> None:
        await sb.write_file("/tmp/rt.bin", blob)
        if await sb.read_file("/tmp/rt.bin") != blob:
            raise RuntimeError("1 MiB round trip returned other bytes")

    res: dict[str, Any] = {"file_1mib_round_trip": await timed(round_trip, 50, warm=5)}
    big = tmp / "big.bin"
    await asyncio.to_thread(big.write_bytes, os.urandom(100 * MiB))
    t = time.perf_counter()
    await sb.write_stream("/tmp/big.bin", big)
    res["upload_100mib_file_mib_s"] = 100 / (time.perf_counter() - t)
    tree = tmp / "tree"
    tree.mkdir()
    os.link(big, tree / "big.bin")
    t = time.perf_counter()
    await sb.upload_dir(tree, "/tmp/tree")
    res["upload_100mib_dir_mib_s"] = 100 / (time.perf_counter() - t)
    await sb.remove("/tmp/big.bin")
    await sb.remove("/tmp/tree", recursive=True)
    return res


def baselines(sb: Sandbox, data_dir: Path, n: int) -> dict[str, Any]:
    pid = int((data_dir / "sandboxes" / sb.id / "init.pid").read_text())
    crun = shutil.which("crun") or "crun"
    wrap = [str(agent_binary()), "crun-wrap"]
    if cgroups.detect().crun_needs_empty_unified:
        wrap += ["--mask-cgroup2", str(data_dir / "run" / "empty")]
    crun_exec = [*wrap, "--", crun, "--root", str(data_dir / "run" / "crun"), "exec", sb.id, "true"]
    nsenter = [shutil.which("nsenter") or "/usr/bin/nsenter", "-t", str(pid), "-a", "true"]
    return {
        "crun_exec": timed_sync(crun_exec, max(50, n // 5)),
        "nsenter": timed_sync(nsenter, n),
    }


async def agent_and_http(sb: Sandbox, url: str, key: str, data_dir: Path, n: int) -> dict[str, Any]:
    import httpx

    agent = AgentClient(data_dir / "run" / "agents" / f"{sb.id}.sock")
    raw = await timed(
        lambda: agent.exec(
            ["/bin/sh", "-c", "true"], env={}, cwd="/", user="root", timeout=None,
            max_output=1024, stdin=None,
        ),
        n,
    )  # fmt: skip
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as h:
        http = await timed(
            lambda: h.post(f"/v1/sandboxes/{sb.id}/exec", json={"command": "true"}), n
        )
    return {"agent_round_trip": raw, "http_exec_route": http}


async def run(opts: argparse.Namespace, url: str, key: str, data_dir: Path) -> dict[str, Any]:
    client = DSecClient(url, key, timeout=600)
    await client.open()
    res: dict[str, Any] = {"docker": docker_status()}
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/tmp"))
    idle: list[Sandbox] = []
    try:
        await client.build_image("busybox")
        spec = DSecContainerRunArgs(
            container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
        )
        sb = await client.run_container(spec.model_copy(update={"memory_limit_mb": 512}))
        res["n1"] = await latencies(sb, opts.execs)
        res["n1"].update(await agent_and_http(sb, url, key, data_dir, opts.execs))
        res["n1"].update(baselines(sb, data_dir, opts.execs))
        res["first_byte"] = await first_byte(sb, 100)
        res.update(await files(sb, tmp))
        for target in (100, opts.idle):
            before = mem_used_bytes()
            start = len(idle)
            while len(idle) < target - 1:
                batch = min(100, target - 1 - len(idle))
                idle += await asyncio.gather(*(client.run_container(spec) for _ in range(batch)))
            # Let the host settle after the burst (crun exits, cgroup and page-cache work)
            # so that "idle sandboxes" are idle when the latency is measured.
            await asyncio.sleep(5)
            if target == opts.idle:
                res["memory_per_idle_sandbox_mib"] = (
                    (mem_used_bytes() - before) / max(1, len(idle) - start) / MiB
                )
            res[f"n{target}"] = await latencies(sb, opts.execs)
            res[f"n{target}"].update(await agent_and_http(sb, url, key, data_dir, opts.execs))
            res[f"n{target}"].update(baselines(sb, data_dir, opts.execs))
        # The HTTP route right after a burst, from the client that did the burst and from
        # a fresh one: shows whether the slowdown seen before was the client's pool.
        from dsec.sdk import _protocol as proto

        old_route = proto.exec_command(sb.id, "true")
        async with DSecClient(url, key) as fresh:
            other = await fresh.get(sb.id)
            res["after_burst"] = {
                "data path, the client that did the burst": await timed(
                    lambda: sb.run_shell("true"), 300
                ),
                "data path, a fresh client": await timed(lambda: other.run_shell("true"), 300),
                "HTTP exec route, the client that did the burst": await timed(
                    lambda: client._send(old_route), 300
                ),
                "HTTP exec route, a fresh client": await timed(lambda: fresh._send(old_route), 300),
            }
    finally:
        for i in range(0, len(idle), 100):
            await asyncio.gather(*(s.stop() for s in idle[i : i + 100]), return_exceptions=True)
        await client.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def print_table(res: dict[str, Any], idle: int) -> None:
    def line(label: str, value: str) -> None:
        print(f"{label:66} {value}")

    def lat(label: str, s: dict[str, float]) -> None:
        line(label, f"{s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f}")

    print(f"\nclient event loop: {res['loop']}")
    line("measure", f"{'p50 ms':>9} {'p99 ms':>9}")
    for n in (1, 100, idle):
        row = res[f"n{n}"]
        for name, label in (
            ("run_shell", "sb.run_shell('true') (target p50 <= 2 ms)"),
            ("session_run", "session.run('true') (target p50 <= 2 ms)"),
            ("agent_round_trip", "baseline: agent alone, unix socket"),
            ("http_exec_route", "baseline: POST /v1/sandboxes/ID/exec (httpx)"),
            ("crun_exec", "baseline: crun exec ID true"),
            ("nsenter", "baseline: nsenter -t PID -a true"),
        ):
            lat(f"{label}, {n} sandboxes", row[name])
    for name in ("run_shell", "session_run"):
        growth = res[f"n{idle}"][name]["p50_ms"] / res["n1"][name]["p50_ms"] - 1
        line(f"{name} p50 growth 1 -> {idle} (target <= 20%)", f"{growth * 100:>8.1f}%")
    lat("time to first streamed byte (target <= 5 ms)", res["first_byte"])
    lat("1 MiB write + read round trip (target <= 20 ms)", res["file_1mib_round_trip"])
    line(
        "100 MiB upload, one file (write_stream)", f"{res['upload_100mib_file_mib_s']:>9.0f} MiB/s"
    )
    line(
        "100 MiB upload, a directory (tar stream)", f"{res['upload_100mib_dir_mib_s']:>9.0f} MiB/s"
    )
    mem = res["memory_per_idle_sandbox_mib"]
    line("host memory per idle sandbox (<= 1.5 MiB)", f"{mem:>9.2f} MiB")
    for name, s in res["after_burst"].items():
        lat(f"after a burst to {idle}: {name}", s)
    print(f"docker exec: {res['docker']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--execs", type=int, default=500)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument(
        "--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the client's loop"
    )
    opts = ap.parse_args()
    os.environ.setdefault("DSEC_MAX_SANDBOXES", str(opts.idle + 100))
    with platform_process() as plat:
        coro = run(opts, plat.url, plat.api_key, plat.data_dir)
        if opts.loop == "uvloop":
            import uvloop

            res = uvloop.run(coro)
        else:
            res = asyncio.run(coro)
    res["loop"] = opts.loop
    res["host"] = {"cpus": os.cpu_count(), "kernel": os.uname().release}
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "sessions.json").write_text(json.dumps(res, indent=2))
    print_table(res, opts.idle)


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
