"""Exec latency against its floor, interleaved (issue 19: exec p50 <= 1.4 ms).

    .venv/bin/python bench/exec_floor.py [--execs 600] [--rounds 20] [--contend CORES]

``run_shell("true")`` through the SDK, async and sync (the sync twin runs the async one
on its portal thread), against the floors of the same command in the same sandbox:
the agent socket's own round trip (``AgentClient.exec`` of ``sh -c true`` from this
process, what the edge does per command without the data path around it),
``nsenter -t PID -a true`` (the kernel's way in, no agent), and the command itself:
``posix_spawn`` + ``waitpid`` of ``sh -c true`` by a static probe inside the sandbox
(bench/spawn_probe.c, built here with gcc; its own timings), what the kernel charges
for a command there with no agent, socket or client at all. So an exec reads as three
layers: the spawn, the agent's protocol around it (agent socket minus spawn), and the
WebSocket hop and the edge (SDK minus agent socket). The arms alternate in ``--rounds``
short batches, the order turning every round, so each sees the same share of a noisy
host's load; the ratios to the agent floor are the figures to read (the absolute ones
move with the host's load). CPU per command is measured too: this process's
(``time.process_time``, the SDK's part) and the edge's (``/proc/PID/stat``), which do
not depend on load. ``--contend CORES`` runs every round a second time with CORES busy
loops at nice -10 (the contended and quiet batches interleaved): one sandbox on a host
that has lost a core the way this fleet's pid 1 takes one from ~8,000 sandboxes, to tell
the exec's growth at 10,000 from the effect of that lost core.

bench/bench_density.py calls :func:`exec_vs_floor` for its exec figure; standalone, this
starts its own ``dsec up`` and writes bench/results/exec_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.probes import static_binary  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402
from dsec.sdk.sync import DSecSyncClient  # noqa: E402
from dsec.sessions.agent_client import AgentClient  # noqa: E402

ARMS = ("sdk_async", "sdk_sync", "agent_socket", "nsenter", "spawn")
PROBE = "spawn_probe.c"
PROBE_IN_SANDBOX = "/tmp/.dsec-bench-spawn-probe"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _timed(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def _timed_sync(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _nsenter(argv: list[str]) -> None:
    pid = os.posix_spawn(argv[0], argv, os.environ)
    os.waitpid(pid, 0)


def build_probe(out_dir: Path) -> bytes | None:
    """The static spawn probe (bench/spawn_probe.c), built with the host's gcc; None
    (said on stderr) where it cannot be built: the run goes on without that arm rather
    than lose the others (bench_density calls this at the end of a long run)."""
    try:
        return static_binary(PROBE, out_dir)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = (
            exc.stderr.decode(errors="replace").strip()[-300:]
            if isinstance(exc, subprocess.CalledProcessError)
            else exc
        )
        print(f"no spawn arm: the probe does not build here ({why})", file=sys.stderr)
        return None


class Burner:
    """``cores`` busy loops at nice -10, stopped until ``running(True)``: the shape of what
    this fleet's pid 1 does to the host from ~8,000 network namespaces (one core, at
    nice -10; bench_density's ``idle_cpu``), with one sandbox, toggled per round so the
    contended and quiet arms interleave."""

    def __init__(self, cores: int) -> None:
        self.procs = [
            subprocess.Popen(["nice", "-n", "-10", "sh", "-c", "while :; do :; done"])
            for _ in range(cores)
        ]
        self.running(False)

    def running(self, on: bool) -> None:
        """Let the loops run (SIGCONT) or stop them (SIGSTOP)."""
        for proc in self.procs:
            proc.send_signal(signal.SIGCONT if on else signal.SIGSTOP)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


async def _spawned(sb: Any, n: int) -> list[float]:
    """``n`` spawn round trips timed by the probe inside the sandbox, in seconds."""
    res = await sb.run_shell(f"{PROBE_IN_SANDBOX} {n}", timeout=60)
    if res.exit_code != 0:
        raise RuntimeError(f"spawn probe failed ({res.exit_code}): {res.stderr[:500]}")
    return [int(line) / 1e9 for line in res.stdout.split()]


async def exec_vs_floor(
    url: str,
    key: str,
    sandbox_id: str,
    data_dir: Path,
    *,
    execs: int = 600,
    rounds: int = 20,
    edge_pid: int | None = None,
    contend: int = 0,
) -> dict[str, Any]:
    """The arms on container ``sandbox_id`` (see the module doc); ``execs`` per arm
    (nsenter: a third of that, it is a process start each). ``contend`` > 0: every
    round runs its arms a second time with that many cores taken by a ``Burner``;
    those figures go under ``"contended"``, in the same shape."""
    sock = data_dir / "run" / "agents" / f"{sandbox_id}.sock"
    init_pid = int((data_dir / "sandboxes" / sandbox_id / "init.pid").read_text())
    agent = AgentClient(sock)
    nsenter = [shutil.which("nsenter") or "/usr/bin/nsenter", "-t", str(init_pid), "-a", "true"]

    async def raw() -> object:
        return await agent.exec(
            ["/bin/sh", "-c", "true"], env={}, cwd="/", user="root", timeout=None,
            max_output=1024, stdin=None,
        )  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="dsec-bench-probe-") as tmp:
        probe = build_probe(Path(tmp))
    arms = ARMS if probe is not None else tuple(a for a in ARMS if a != "spawn")
    conditions = ("quiet", "contended") if contend > 0 else ("quiet",)
    samples = {c: {a: list[float]() for a in arms} for c in conditions}
    cpu = {c: {a: 0.0 for a in arms} for c in conditions}
    edge_cpu = {c: {a: 0.0 for a in arms} for c in conditions}
    per = max(1, execs // rounds)
    burner: Burner | None = None
    async with DSecClient(url, key) as client:
        sb = await client.get(sandbox_id)
        if probe is not None:
            await sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        sync = DSecSyncClient(url, key)
        try:
            # made inside the try: its busy loops are killed whatever fails below
            burner = Burner(contend) if contend > 0 else None
            ssb = await asyncio.to_thread(sync.get, sandbox_id)
            batches: dict[str, Callable[[int], Awaitable[list[float]]]] = {
                "sdk_async": lambda k: _timed(lambda: sb.run_shell("true"), k),
                # the whole batch in one thread: the timings are the sync client's own
                "sdk_sync": lambda k: asyncio.to_thread(
                    _timed_sync, lambda: ssb.run_shell("true"), k
                ),
                "agent_socket": lambda k: _timed(raw, k),
                "nsenter": lambda k: asyncio.to_thread(
                    _timed_sync, lambda: _nsenter(nsenter), max(1, k // 3)
                ),
                "spawn": lambda k: _spawned(sb, k),
            }
            for arm in arms:  # warm every path (connections, the agent, the page cache)
                await batches[arm](20)
            for r in range(rounds):
                k = r % len(arms)
                # the conditions alternate their order too
                for cond in conditions[r % 2 :] + conditions[: r % 2]:
                    if burner is not None:
                        burner.running(cond == "contended")
                    for arm in arms[k:] + arms[:k]:
                        t0 = time.process_time()
                        e0 = cpu_seconds(edge_pid) if edge_pid else 0.0
                        samples[cond][arm] += await batches[arm](per)
                        cpu[cond][arm] += time.process_time() - t0
                        if edge_pid:
                            edge_cpu[cond][arm] += cpu_seconds(edge_pid) - e0
        finally:
            if burner is not None:
                burner.close()
            await asyncio.to_thread(sync.close)
    res = _summarise(arms, samples["quiet"], cpu["quiet"], edge_cpu["quiet"], edge_pid)
    if burner is not None:
        res["contended"] = _summarise(
            arms, samples["contended"], cpu["contended"], edge_cpu["contended"], edge_pid
        )
        res["contended"]["burner_cores"] = contend
    return res


def _summarise(
    arms: tuple[str, ...],
    samples: dict[str, list[float]],
    cpu: dict[str, float],
    edge_cpu: dict[str, float],
    edge_pid: int | None,
) -> dict[str, Any]:
    """Per arm: the summary, CPU per command, the ratio to the agent floor; the layers."""
    res: dict[str, Any] = {}
    for arm in arms:
        s = summary(samples[arm])
        n = max(1, len(samples[arm]))
        s["client_cpu_ms"] = round(cpu[arm] / n * 1000, 3)
        if edge_pid:
            s["edge_cpu_ms"] = round(edge_cpu[arm] / n * 1000, 3)
        res[arm] = s
    floor = res["agent_socket"]["p50_ms"]
    for arm in arms:
        if arm != "agent_socket":
            res[arm]["over_agent_p50"] = round(res[arm]["p50_ms"] / floor, 3)
    if "spawn" in res:
        spawn = res["spawn"]["p50_ms"]
        res["layers_p50_ms"] = {  # where an exec's time goes (differences of medians)
            "spawn": spawn,
            "agent_protocol": round(floor - spawn, 3),
            "websocket_and_edge": round(res["sdk_async"]["p50_ms"] - floor, 3),
        }
    res["exec_p50_ms"] = res["sdk_async"]["p50_ms"]
    res["exec_p99_ms"] = res["sdk_async"]["p99_ms"]
    res["n"] = res["sdk_async"]["n"]
    return res


def print_table(res: dict[str, Any]) -> None:
    labels = {
        "sdk_async": 'run_shell("true"), async SDK',
        "sdk_sync": 'run_shell("true"), sync SDK',
        "agent_socket": "floor: agent socket round trip",
        "nsenter": "floor: nsenter -t PID -a true",
        "spawn": "floor: spawn sh -c true inside",
    }
    print(f"\n{'':34} {'n':>5} {'p50 ms':>7} {'p99 ms':>7} {'/agent':>7} {'cpu ms':>7} {'edge':>6}")
    for arm in (a for a in ARMS if a in res):
        s = res[arm]
        ratio = f"{s['over_agent_p50']:.2f}x" if "over_agent_p50" in s else ""
        edge = f"{s['edge_cpu_ms']:.3f}" if "edge_cpu_ms" in s else ""
        print(
            f"{labels[arm]:34} {s['n']:>5} {s['p50_ms']:>7.3f} {s['p99_ms']:>7.2f} "
            f"{ratio:>7} {s['client_cpu_ms']:>7.3f} {edge:>6}"
        )
    lay = res.get("layers_p50_ms")
    if lay is None:
        return
    print(
        f"an exec's p50 in layers: spawn {lay['spawn']:.3f} ms + agent protocol "
        f"{lay['agent_protocol']:.3f} + WebSocket hop and edge {lay['websocket_and_edge']:.3f}"
    )


def loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as fh:
        return " ".join(fh.read().split()[:3])


async def _standalone(opts: argparse.Namespace, url: str, key: str, plat: Any) -> dict[str, Any]:
    async with DSecClient(url, key, timeout=300) as client:
        await client.build_image("busybox")
        sb = await client.run_container(
            DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
            )
        )
        try:
            return await exec_vs_floor(
                url, key, sb.id, plat.data_dir, execs=opts.execs, rounds=opts.rounds,
                edge_pid=plat.proc.pid if plat.proc else None, contend=opts.contend,
            )  # fmt: skip
        finally:
            await sb.stop()


def main() -> None:
    from tests.conftest import platform_process

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--execs", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--contend", type=int, default=0, metavar="CORES",
        help="also run every round with CORES busy loops at nice -10 (interleaved)",
    )  # fmt: skip
    opts = ap.parse_args()
    load_start = loadavg()
    with platform_process() as plat:
        res = asyncio.run(_standalone(opts, plat.url, plat.api_key, plat))
    res["host"] = {"loadavg_start": load_start, "loadavg_end": loadavg()}
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "exec_floor.json").write_text(json.dumps(res, indent=2))
    print_table(res)
    if "contended" in res:
        print(f"\nthe same, {opts.contend} core(s) taken by busy loops at nice -10:")
        print_table(res["contended"])
    print(f"host load {load_start} -> {res['host']['loadavg_end']}")


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
