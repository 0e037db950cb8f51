"""Where an idle sandbox's host memory goes (issue 19): the difference of the host's
kernel and process figures between N and N + ``--delta`` idle busybox sandboxes.

    .venv/bin/python bench/density_breakdown.py [--base 300] [--delta 200] [--top 15]

Starts its own `dsec up` (default settings), creates ``--base`` sandboxes, takes a
snapshot, creates ``--delta`` more, takes another, and prints per added sandbox:
``/proc/meminfo`` (MemAvailable, Slab split into reclaimable and not, Percpu,
KernelStack, PageTables, VmallocUsed), the largest ``/proc/slabinfo`` caches, the RSS
and PSS of the edge, the spawner and the sandboxes' inits (``smaps_rollup``), the
host's memory cgroups (``/proc/cgroups``) and one sandbox's mounts (how many distinct
superblocks: each registers a memory-cgroup-aware shrinker, and every memory cgroup
keeps a slot per shrinker). Writes bench/results/density_breakdown.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import PlatformProcess, clean_leftovers, host_leaks  # noqa: E402

from bench.bench_density import meminfo, memory_cgroups, spec  # noqa: E402
from dsec import DSecClient  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MEMINFO_KEYS = (
    "MemAvailable",
    "MemFree",
    "Slab",
    "SReclaimable",
    "SUnreclaim",
    "Percpu",
    "KernelStack",
    "PageTables",
    "VmallocUsed",
    "AnonPages",
    "Shmem",
    "Cached",
)


def slabinfo() -> dict[str, int]:
    """Bytes of slab pages per cache (``num_slabs * pagesperslab * PAGE``)."""
    out: dict[str, int] = {}
    with open("/proc/slabinfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(("slabinfo", "#")):
                continue
            parts = line.split()
            name, pages = parts[0], int(parts[5])
            num_slabs = int(parts[parts.index("slabdata") + 2])
            out[name] = out.get(name, 0) + num_slabs * pages * PAGE
    return out


def rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of a process in KiB (zeros if it is gone)."""
    out = {"Rss": 0, "Pss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                key = line.split(":")[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.scandir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{entry.name}/children").read_text()
        except OSError:
            continue
        out += [int(p) for p in text.split()]
    return out


def memcgs() -> int:
    return memory_cgroups() or 0


def superblocks(pid: int) -> dict[str, int]:
    """One process's mounts and the distinct superblocks under them, by fs type."""
    seen: dict[str, str] = {}
    mounts = 0
    with open(f"/proc/{pid}/mountinfo", encoding="ascii") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            mounts += 1
            seen[left.split()[2]] = right.split()[0]
    by: dict[str, int] = {"mounts": mounts, "superblocks": len(seen)}
    for fstype in seen.values():
        by[fstype] = by.get(fstype, 0) + 1
    return by


def snapshot(plat: PlatformProcess, sandbox_dir: Path, ids: list[str]) -> dict[str, Any]:
    edge = plat.proc.pid if plat.proc else 0
    spawners = [p for p in children(edge) if "spawn" in _cmdline(p)]
    inits = []
    for sid in ids:
        with contextlib.suppress(OSError, ValueError):
            inits.append(int((sandbox_dir / sid / "init.pid").read_text()))
    init_mem = {"Rss": 0, "Pss": 0}
    for pid in inits:
        r = rollup(pid)
        init_mem = {k: init_mem[k] + r[k] for k in init_mem}
    crun = sum(1 for p in _pids() if _comm(p) == "crun")
    return {
        "meminfo": {k: v for k, v in meminfo().items() if k in MEMINFO_KEYS},
        "slab": slabinfo(),
        "edge": rollup(edge),
        "spawners": [rollup(p) for p in spawners],
        "inits": init_mem,
        "memcgs": memcgs(),
        "crun_processes": crun,
        "one_sandbox": superblocks(inits[-1]) if inits else {},
    }


def _pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def diff(a: dict[str, Any], b: dict[str, Any], n: int, top: int) -> dict[str, Any]:
    kib = 1024
    per = {k: round((a["meminfo"][k] - b["meminfo"][k]) * (1 if k == "MemAvailable" else -1)
                    / n, 1) for k in MEMINFO_KEYS}  # fmt: skip
    per["MemAvailable"] = round((b["meminfo"]["MemAvailable"] - a["meminfo"]["MemAvailable"])
                                / n, 1)  # fmt: skip
    slab = {k: (a["slab"].get(k, 0) - b["slab"].get(k, 0)) / n / kib for k in a["slab"]}
    biggest = sorted(slab.items(), key=lambda kv: -kv[1])[:top]
    sp_a = sum(s["Pss"] for s in a["spawners"])
    sp_b = sum(s["Pss"] for s in b["spawners"])
    return {
        "per_sandbox_kib": {
            "meminfo": per,
            "slab_caches": {k: round(v, 2) for k, v in biggest},
            "edge_pss": round((a["edge"]["Pss"] - b["edge"]["Pss"]) / n, 1),
            "spawner_pss": round((sp_a - sp_b) / n, 1),
            "init_pss": round((a["inits"]["Pss"] - b["inits"]["Pss"]) / n, 1),
            "init_rss": round((a["inits"]["Rss"] - b["inits"]["Rss"]) / n, 1),
        },
        "memcgs_added": a["memcgs"] - b["memcgs"],
        "crun_processes": a["crun_processes"],
        "one_sandbox_mounts": a["one_sandbox"],
    }


async def run(opts: argparse.Namespace, plat: PlatformProcess) -> dict[str, Any]:
    async with DSecClient(plat.url, plat.api_key, timeout=600) as client:
        await client.build_image("busybox")
        made: list[Any] = []
        try:
            for _ in range(opts.base):
                made.append(await client.run_container(spec()))
            await asyncio.sleep(2)
            sdir = plat.data_dir / "sandboxes"
            first = snapshot(plat, sdir, [s.id for s in made])
            for _ in range(opts.delta):
                made.append(await client.run_container(spec()))
            await asyncio.sleep(2)
            second = snapshot(plat, sdir, [s.id for s in made])
        finally:
            gate = asyncio.Semaphore(16)

            async def stop(sb: Any) -> None:
                async with gate:
                    await sb.stop()

            await asyncio.gather(*(stop(s) for s in made), return_exceptions=True)
    out = diff(second, first, opts.delta, opts.top)
    out["at"] = {"base": opts.base, "delta": opts.delta}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", type=int, default=300)
    ap.add_argument("--delta", type=int, default=200)
    ap.add_argument("--top", type=int, default=15)
    opts = ap.parse_args()
    base_dir = Path(tempfile.mkdtemp(prefix="dsec-breakdown-", dir="/tmp"))
    edge_id = "b" + secrets.token_hex(4)
    plat = PlatformProcess(data_dir=base_dir / "d", edge_id=edge_id, extra_env={})
    plat.data_dir.mkdir()
    res: dict[str, Any] = {}
    t = time.monotonic()
    try:
        plat.start()
        res = asyncio.run(run(opts, plat))
    finally:
        plat.stop()
        res["leaks"] = host_leaks(plat.data_dir, edge_id)
        clean_leftovers(plat.data_dir, edge_id)
        shutil.rmtree(base_dir, ignore_errors=True)
    res["seconds"] = round(time.monotonic() - t, 1)
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "density_breakdown.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
