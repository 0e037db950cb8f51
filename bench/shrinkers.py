"""What one memory cgroup costs on this host before anything is charged to it: the
kernel's per-memory-cgroup shrinker map (issue 19).

Every superblock registers a memory-cgroup-aware shrinker, and every memory cgroup keeps
a slot for every shrinker id the host has had alive *at once* (``shrinker_nr_max`` in
mm/shrinker.c, which never shrinks): since 6.7 in units of 64 ids, each unit a 520-byte
``shrinker_info_unit`` in kmalloc-1k. So a host that once held N sandboxes of S
superblocks each charges every later memory cgroup ~16 B x N x S until it reboots, and
the whole population costs O(N^2 x S). This is host history, not the platform's doing;
what the platform controls is S (bench/density_breakdown.py counts it).

The probe makes ``probes`` empty memory cgroups and reads how many kmalloc-1k objects
each added, the median of ``rounds`` tries: other work on the host allocates and frees
kmalloc-1k objects meanwhile, so take it on a quiet host (or read it as +-10%).

    .venv/bin/python bench/shrinkers.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsec.resources import cgroups  # noqa: E402

UNIT_IDS = 64  # SHRINKER_UNIT_BITS: ids per shrinker_info_unit
UNIT_BYTES = 1024  # a 520-byte unit lives in kmalloc-1k


def kmalloc_1k_objects() -> int:
    with open("/proc/slabinfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("kmalloc-1k "):
                return int(line.split()[1])
    raise RuntimeError("no kmalloc-1k in /proc/slabinfo")


def memory_root() -> Path:
    host = cgroups.detect()
    if "memory" in host.v1:
        return host.v1["memory"]
    if host.v2 is not None:
        return host.v2
    raise RuntimeError("no memory cgroup hierarchy")


def probe(probes: int = 50, rounds: int = 5) -> dict[str, float]:
    """``units_per_memcg`` (kmalloc-1k objects one empty memory cgroup adds),
    ``shrinker_ids`` (the host's high-water mark, units x 64) and
    ``map_kib_per_memcg``."""
    root = memory_root()
    tries: list[float] = []
    for r in range(rounds):
        dirs = [root / f"dsec-shrinker-probe-{os.getpid()}-{r}-{i}" for i in range(probes)]
        before = kmalloc_1k_objects()
        made: list[Path] = []
        try:
            for d in dirs:
                d.mkdir()
                made.append(d)
            after = kmalloc_1k_objects()
        finally:
            for d in made:
                d.rmdir()
        tries.append((after - before) / probes)
    units = sorted(tries)[len(tries) // 2]
    return {
        "units_per_memcg": round(units, 1),
        "shrinker_ids": int(units * UNIT_IDS),
        "map_kib_per_memcg": round(units * UNIT_BYTES / 1024, 1),
    }


def _devices(pid: int | str) -> dict[str, str]:
    """Distinct superblocks (device ids) under a process's mounts, with their fs type."""
    seen: dict[str, str] = {}
    with open(f"/proc/{pid}/mountinfo", encoding="ascii") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            seen[left.split()[2]] = right.split()[0]
    return seen


def superblocks(pid: int) -> dict[str, int]:
    """One process's mounts, the distinct superblocks under them by fs type, and
    ``own_superblocks``: those the host's mount table (ours) does not have, i.e. what
    this process's namespaces added (the S of the module docstring)."""
    with open(f"/proc/{pid}/mountinfo", encoding="ascii") as fh:
        mounts = sum(1 for _ in fh)
    seen = _devices(pid)
    host = _devices("self")
    by: dict[str, int] = {
        "mounts": mounts,
        "superblocks": len(seen),
        "own_superblocks": sum(1 for dev in seen if dev not in host),
    }
    for fstype in seen.values():
        by[fstype] = by.get(fstype, 0) + 1
    return by


if __name__ == "__main__":
    print(json.dumps(probe()))
