"""Density (issue 19): idle busybox sandboxes until ``--max`` or the first failure, with
the host's raw ``crun run --detach`` of the same layer measured alongside at every step.

    .venv/bin/python bench/bench_density.py [--max 10000] [--step 1000] [--burst 32]
        [--raw 20] [--execs 300] [--qos] [--pause]

Starts its own `dsec up` on a fresh data directory with default settings: the sandbox
count admission allows is the platform's own, derived from the host (memory, pids,
threads, files, the edge's fds; dsec.resources.capacity), printed at the start and
recorded; a ``DSEC_MAX_SANDBOXES`` already in the environment is passed on and recorded
as such. A typed refusal before ``--max`` is the run's first failure. Every sandbox is
busybox with a 64 MiB limit and no idle TTL. Per step (every ``--step`` sandboxes):

- host memory per sandbox: the drop of ``MemAvailable`` since before the first sandbox,
  divided by the count, and its kernel part (``Slab + KernelStack + PageTables`` growth)
  and, without Slab's reclaimable part (dentries and inodes of any other work on the
  host, which pressure takes back), ``SUnreclaim + Percpu + KernelStack + PageTables``;
- sequential create p50/p99 of the creates of that step (each create is timed; they are
  the step's sandboxes), and the ratio to raw crun measured right then; with warm
  sandboxes on (the default) back-to-back creates are a mix of creates a warm sandbox
  served and creates that started their own container while the pool refilled:
  ``creates_served_warm`` says how many of the step's were the former;
- the burst rate: ``--burst`` creates at once (they stay, counted in N);
- raw ``crun run --detach`` of the same EROFS layer with an own overlay, ``--raw`` times
  (dsec.crun_baseline: mounted, run, deleted; the sandboxes present are the same);
- where the host's CPU goes while the sandboxes sit idle (``idle_cpu``, 3 s): all of
  it, the edge's and the host's pid 1's, in cores. On this fleet's machines pid 1 is
  their own agent (``process_api``), no part of the platform, whose work grows with the
  host's network namespaces (one a sandbox): from ~6,000 sandboxes it takes a whole
  core of the two, so the later steps' creates (and raw crun's) run on what is left.
  What is left is measured too: a busy loop pinned to each core for 1 s
  (``spin_per_core``, against ``spin_per_core_start`` with no sandbox). The verdicts put
  raw crun's own growth, pid 1's cores at the first and last step and the share of the
  cores left at the last (``cpu_left_at_last_step``) beside the platform's growth.

At the end: exec p50/p99 of ``run_shell("true")`` on one sandbox with its floors (the
agent socket's round trip, nsenter, the bare spawn inside) interleaved (bench/exec_floor.py),
and the exec's p50 split into those layers; then all sandboxes stopped
(timed), the platform stopped and the host checked for leaks (mounts, cgroups,
processes, runtime state, loop devices, netns/veths/nft, spawners). ``--qos`` adds the
QoS run of bench/bench_qos.py on the same platform once the sandboxes are gone; the pause
run (100 x 256 MiB paused and resumed) is bench/bench_pause.py, run by ``--pause`` when
that module is present. Writes bench/results/density.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import PlatformProcess, clean_leftovers, host_leaks  # noqa: E402

from bench.exec_floor import cpu_seconds, exec_vs_floor  # noqa: E402
from bench.probes import empty_host_spin, spin_capacity  # noqa: E402
from bench.shrinkers import probe as shrinker_probe  # noqa: E402
from bench.shrinkers import superblocks  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs  # noqa: E402
from dsec.crun_baseline import RawCrun, blob_path, unavailable  # noqa: E402

KERNEL_KEYS = ("Slab", "KernelStack", "PageTables")
# Slab's reclaimable part is mostly dentries and inodes of whatever else the host does
# (and goes under pressure): the kernel memory the sandboxes pin is the rest.
PINNED_KEYS = ("SUnreclaim", "Percpu", "KernelStack", "PageTables")
TARGETS = {
    "host_mib_per_sandbox": 1.0,
    "create_growth_1k_to_10k": 1.3,
    "create_over_raw_p50": 1.25,
    "exec_p50_ms": 1.4,
    "qos_inflation_p50": 0.20,
}


def loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as fh:
        return " ".join(fh.read().split()[:3])


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0])
    return out


def edge_fds(pid: int | None) -> int | None:
    """How many fds the edge process holds (None: not ours to look at)."""
    if pid is None:
        return None
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def host_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat; idle and iowait are not busy)."""
    with open("/proc/stat", encoding="ascii") as fh:
        ticks = [int(v) for v in fh.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def comm(pid: int) -> str:
    """The process's name ("?" if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


async def idle_cpu(edge_pid: int | None, seconds: float = 3.0) -> dict[str, Any]:
    """Where the host's CPU goes while the sandboxes sit idle, in cores: all of it, the
    edge's, and the host's pid 1's. The last is no part of the platform, and on this
    fleet's machines it is their own agent (``process_api``), whose work grows with the
    host's network namespaces (one a sandbox): from ~6,000 sandboxes it takes a whole
    core of the two (0.08 at 1,000, 0.53 at 4,000): the creates and commands of the
    later steps share what is left with it, and so does raw crun beside them."""
    cores = os.cpu_count() or 1
    busy0, total0 = host_busy()
    pid1_0 = cpu_seconds(1)
    edge0 = cpu_seconds(edge_pid) if edge_pid else 0.0
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    dt = time.perf_counter() - t0
    busy1, total1 = host_busy()
    out: dict[str, Any] = {
        "host_cores": round((busy1 - busy0) / max(1, total1 - total0) * cores, 2),
        "pid1_cores": round((cpu_seconds(1) - pid1_0) / dt, 2),
        "pid1": comm(1),
        "processes": sum(1 for d in os.listdir("/proc") if d.isdigit()),
    }
    if edge_pid:
        out["edge_cores"] = round((cpu_seconds(edge_pid) - edge0) / dt, 2)
    out["spin_per_core"] = [round(v) for v in await spin_capacity(1.0)]
    return out


def memory_cgroups() -> int | None:
    """The host's memory cgroups, dying ones included (/proc/cgroups): each costs
    ~16 bytes per shrinker id of the host's high-water mark (bench/shrinkers.py)."""
    with open("/proc/cgroups", encoding="ascii") as fh:
        for line in fh:
            parts = line.split()
            if parts and parts[0] == "memory":
                return int(parts[2])
    return None


async def warm_hits(url: str, key: str) -> int | None:
    """Creates served by a warm sandbox so far (dsec.edge.warmpool, on by default): a
    step's sequential creates are a mix of those and creates that start their own
    container, and the row says how many of each."""
    async with httpx.AsyncClient(timeout=30) as h:
        resp = await h.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    found = re.search(r"^dsec_warm_hits_total ([0-9.e+]+)$", resp.text, re.M)
    return int(float(found.group(1))) if found else None


def spec() -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image="busybox:latest", memory_limit_mb=64, ttl_running_stop=None
    )


def memory_row(base: dict[str, int], count: int) -> dict[str, float]:
    now = meminfo()
    avail = (base["MemAvailable"] - now["MemAvailable"]) / 1024
    kernel = sum(now[k] - base[k] for k in KERNEL_KEYS) / 1024
    pinned = sum(now[k] - base[k] for k in PINNED_KEYS) / 1024
    return {
        "mem_available_drop_mib": round(avail, 1),
        "host_mib_per_sandbox": round(avail / count, 3),
        "kernel_mib_per_sandbox": round(kernel / count, 3),
        "kernel_unreclaimable_mib_per_sandbox": round(pinned / count, 3),
    }


class Density:
    """One run's state: the sandboxes made so far and what each step measured."""

    def __init__(
        self,
        opts: argparse.Namespace,
        client: DSecClient,
        raw: RawCrun | None,
        edge_pid: int | None = None,
        sandbox_dir: Path | None = None,
        api: tuple[str, str] | None = None,
    ):
        self.opts = opts
        self.api = api  # (url, API key): where the warm-hit counter is read
        self.client = client
        self.raw = raw
        # The edge's open fds, before the first sandbox and at each step: what one
        # sandbox costs of its RLIMIT_NOFILE (dsec.resources.capacity, edge_fds).
        self.edge_pid = edge_pid
        self.base_fds = edge_fds(edge_pid)
        self.sandbox_dir = sandbox_dir
        self.made: list[Any] = []
        self.steps: list[dict[str, Any]] = []
        self.failure: str | None = None

    def own_superblocks(self) -> int | None:
        """Superblocks the first sandbox's namespaces added (bench/shrinkers.py): what
        each sandbox adds to every memory cgroup's shrinker map."""
        if self.sandbox_dir is None or not self.made:
            return None
        try:
            pid = int((self.sandbox_dir / self.made[0].id / "init.pid").read_text())
            return superblocks(pid)["own_superblocks"]
        except (OSError, ValueError):
            return None

    async def create(self) -> float:
        t = time.perf_counter()
        self.made.append(await self.client.run_container(spec()))
        return time.perf_counter() - t

    async def burst(self) -> dict[str, float]:
        n = min(self.opts.burst, self.opts.max - len(self.made))
        if n <= 0:
            return {}
        t = time.perf_counter()
        got = await asyncio.gather(
            *(self.client.run_container(spec()) for _ in range(n)), return_exceptions=True
        )
        elapsed = time.perf_counter() - t
        ok = [g for g in got if not isinstance(g, BaseException)]
        self.made += ok
        bad = [g for g in got if isinstance(g, BaseException)]
        if bad:
            self.failure = f"burst: {type(bad[0]).__name__}: {bad[0]}"
        return {"burst_n": len(ok), "burst_s": round(elapsed, 3), "burst_per_s": len(ok) / elapsed}

    async def raw_figure(self) -> dict[str, float]:
        if self.raw is None or self.opts.raw <= 0:
            return {}
        raw = self.raw
        samples = await asyncio.to_thread(raw.measure_detached, self.opts.raw, 2)
        s = summary(samples)
        return {"raw_p50_ms": s["p50_ms"], "raw_p99_ms": s["p99_ms"]}

    async def run(self, base: dict[str, int]) -> None:
        target = self.opts.step
        while len(self.made) < self.opts.max and self.failure is None:
            times: list[float] = []
            hits_before = await warm_hits(*self.api) if self.api else None
            while len(self.made) < min(target, self.opts.max) - self.opts.burst:
                try:
                    times.append(await self.create())
                except Exception as exc:  # the first failure ends the run: say which
                    self.failure = f"create #{len(self.made) + 1}: {type(exc).__name__}: {exc}"
                    break
            hits_after = await warm_hits(*self.api) if self.api else None  # before the burst
            row: dict[str, Any] = {}
            if self.failure is None:
                row.update(await self.burst())
            row["count"] = len(self.made)
            row.update(memory_row(base, max(1, len(self.made))))
            row["memory_cgroups"] = memory_cgroups()  # live and dying, host-wide
            row["own_superblocks_per_sandbox"] = self.own_superblocks()
            fds = edge_fds(self.edge_pid)
            if fds is not None and self.base_fds is not None and self.made:
                row["edge_fds_per_sandbox"] = round((fds - self.base_fds) / len(self.made), 2)
            if times:
                s = summary(times)
                row.update(create_p50_ms=s["p50_ms"], create_p99_ms=s["p99_ms"], creates=len(times))
                if hits_before is not None and hits_after is not None:
                    row["creates_served_warm"] = hits_after - hits_before
            row.update(await self.raw_figure())
            if "raw_p50_ms" in row and "create_p50_ms" in row:
                row["create_over_raw_p50"] = round(row["create_p50_ms"] / row["raw_p50_ms"], 2)
            row["idle_cpu"] = await idle_cpu(self.edge_pid)
            self.steps.append(row)
            print(json.dumps(row), flush=True)
            target += self.opts.step

    async def remove_all(self) -> dict[str, float]:
        gate = asyncio.Semaphore(16)

        async def stop(sb: Any) -> None:
            async with gate:
                await sb.stop()

        t = time.perf_counter()
        got = await asyncio.gather(*(stop(sb) for sb in self.made), return_exceptions=True)
        failed = sum(isinstance(g, BaseException) for g in got)
        return {
            "removed": len(self.made) - failed,
            "failed": failed,
            "seconds": round(time.perf_counter() - t, 2),
        }


async def run(opts: argparse.Namespace, plat: PlatformProcess) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with DSecClient(plat.url, plat.api_key, timeout=600) as client:
        admission = (await client.health()).admission
        res["admission"] = admission
        by = admission.get("capacity_limited_by")
        print(
            f"admission capacity {admission.get('capacity')} sandboxes (limited by {by}"
            + (": DSEC_MAX_SANDBOXES)" if by == "setting" else ", default settings)"),
            flush=True,
        )
        await client.build_image("busybox")
        layers = (await client.get_image("busybox:latest")).layers
        blob = blob_path(plat.data_dir, layers[0]) if len(layers) == 1 else None
        why = "busybox has more than one layer" if blob is None else unavailable(blob)
        for _ in range(3):  # warm the platform's path before the baseline is taken
            await (await client.run_container(spec())).stop()
        await asyncio.sleep(1.0)
        res["shrinker_map_start"] = shrinker_probe()
        res["spin_per_core_start"] = await empty_host_spin()
        base = meminfo()
        with RawCrun(blob) if blob is not None and why is None else _nothing() as raw:
            dens = Density(
                opts, client, raw, plat.proc.pid if plat.proc else None,
                plat.data_dir / "sandboxes", (plat.url, plat.api_key),
            )  # fmt: skip
            try:
                await dens.run(base)
                if dens.made:  # exec with its floors (agent socket, nsenter, spawn) interleaved
                    res["exec"] = await exec_vs_floor(
                        plat.url, plat.api_key, dens.made[0].id, plat.data_dir,
                        execs=opts.execs, edge_pid=plat.proc.pid if plat.proc else None,
                    )  # fmt: skip
                res["shrinker_map_end"] = shrinker_probe()
            finally:
                res["remove"] = await dens.remove_all()
        res["steps"] = dens.steps
        res["failure"] = dens.failure
        res["raw_note"] = why
        if opts.qos:
            qos = importlib.import_module("bench.bench_qos")
            qopts = argparse.Namespace(
                rounds=opts.qos_rounds, batch_ms=250.0, burners=1, burner_cpus=1.0, settle=0.1
            )
            res["qos"] = await qos.run(
                qopts, plat.url, plat.api_key, plat.edge_id, plat.proc.pid if plat.proc else None
            )
    return res


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def pause_run(opts: argparse.Namespace) -> dict[str, Any]:
    """The pause run lives in bench/bench_pause.py (issue 19 items 2-3)."""
    try:
        mod = importlib.import_module("bench.bench_pause")
    except ImportError:
        return {"note": "bench/bench_pause.py is not on this branch (branch densitymem)"}
    main = getattr(mod, "main", None)
    if main is None:
        return {"note": "bench/bench_pause.py has no main()"}
    saved = sys.argv
    sys.argv = ["bench_pause.py"]
    try:
        main()
    finally:
        sys.argv = saved
    return {"note": "see bench/results of bench_pause.py"}


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    steps = [s for s in res["steps"] if "create_p50_ms" in s]
    out: dict[str, Any] = {}
    if steps:
        last = steps[-1]
        out["host_mib_per_sandbox"] = last["host_mib_per_sandbox"]
        out["count"] = last["count"]
        out["create_growth_first_to_last_step"] = round(
            last["create_p50_ms"] / steps[0]["create_p50_ms"], 2
        )
        ratios = [s["create_over_raw_p50"] for s in steps if "create_over_raw_p50" in s]
        if ratios:
            out["create_over_raw_p50"] = sorted(ratios)[len(ratios) // 2]
        if "raw_p50_ms" in steps[0] and "raw_p50_ms" in last:  # the same host's own growth
            out["raw_crun_growth_first_to_last_step"] = round(
                last["raw_p50_ms"] / steps[0]["raw_p50_ms"], 2
            )
        if "idle_cpu" in steps[0] and "idle_cpu" in last:  # what the host took meanwhile
            out["pid1_cores_first_to_last_step"] = [
                steps[0]["idle_cpu"]["pid1_cores"],
                last["idle_cpu"]["pid1_cores"],
            ]
            start = res.get("spin_per_core_start")
            if start and sum(start) and "spin_per_core" in last["idle_cpu"]:
                # the share of the host's cores a busy loop still gets at the last step
                out["cpu_left_at_last_step"] = round(
                    sum(last["idle_cpu"]["spin_per_core"]) / sum(start), 2
                )
        mapped = res.get("shrinker_map_end")
        if mapped:  # host history the platform cannot undo (bench/shrinkers.py)
            map_mib = mapped["map_kib_per_memcg"] / 1024
            out["shrinker_map_mib_per_memcg"] = round(map_mib, 3)
            out["host_mib_per_sandbox_less_shrinker_map"] = round(
                last["host_mib_per_sandbox"] - map_mib, 3
            )
    if res.get("exec"):
        out["exec_p50_ms"] = res["exec"]["exec_p50_ms"]
        out["exec_over_agent_socket_p50"] = res["exec"]["sdk_async"]["over_agent_p50"]
        if "layers_p50_ms" in res["exec"]:  # without gcc there is no spawn arm
            out["exec_layers_p50_ms"] = res["exec"]["layers_p50_ms"]
    if "qos" in res:
        out["qos_inflation_p50"] = res["qos"]["with_qos"]["inflation_p50_per_round"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max", type=int, default=10000)
    ap.add_argument("--step", type=int, default=1000)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--raw", type=int, default=20)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--qos", action="store_true", help="also the QoS run (bench_qos)")
    ap.add_argument("--qos-rounds", type=int, default=10)
    ap.add_argument("--pause", action="store_true", help="also bench/bench_pause.py")
    opts = ap.parse_args()
    configured = os.environ.get("DSEC_MAX_SANDBOXES")
    base_dir = Path(tempfile.mkdtemp(prefix="dsec-density-", dir="/tmp"))
    edge_id = "b" + secrets.token_hex(4)
    plat = PlatformProcess(
        data_dir=base_dir / "d",
        edge_id=edge_id,
    )
    plat.data_dir.mkdir()
    res: dict[str, Any] = {}
    load_start = loadavg()
    try:
        plat.start()
        res = asyncio.run(run(opts, plat))
    finally:
        plat.stop()
        leaks = host_leaks(plat.data_dir, edge_id)
        clean_leftovers(plat.data_dir, edge_id)
        shutil.rmtree(base_dir, ignore_errors=True)
    res["leaks"] = leaks
    if opts.pause:
        res["pause"] = pause_run(opts)
    res["verdicts"] = verdicts(res)
    res["targets"] = TARGETS
    res["host"] = {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "max_sandboxes_env": configured,
        # A shared host: other work moves every figure; the raw ratio is the steadier one.
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "argv": sys.argv[1:],
    }
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "density.json").write_text(json.dumps(res, indent=2))
    print(
        json.dumps(
            {k: res[k] for k in ("verdicts", "exec", "remove", "failure", "leaks") if k in res},
            indent=2,
        )
    )


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
