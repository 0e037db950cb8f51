"""What this host can hold, measured rather than assumed: admission's inputs.

Two kinds of figure, both read from /proc and /sys (a few file reads, no syscall loop):

* **capacity**: how many sandboxes the host's finite tables allow, each divided by what
  one idle sandbox costs of it. Memory: the most sandboxes whose host memory fits in
  ``MemTotal`` less a reserve for the host. That memory is not N times a constant
  (``SandboxCost.memory_of``): each sandbox costs its own part (kernel memory of its
  cgroups, namespaces and mounts plus its processes: 0.55-0.66 MiB measured here for
  idle busybox sandboxes, issue 19, so 704 KiB by default, ``DSEC_SANDBOX_HOST_COST_KB``)
  plus its memory cgroup's shrinker map, which has a slot for every superblock on the
  host: 5 for each sandbox, so the map grows with N and all N of them with N squared
  (0.77 MiB a sandbox at 10,000; bench/shrinkers.py, bench/host_floor.py). A constant
  per sandbox would promise a large host several times the sandboxes it can hold:
  1.5 MiB each on 512 GiB says ~348,000, counting the map ~78,000. Tasks: ``pid_max``
  and ``threads-max`` over the tasks of an idle sandbox (measured: 1, its agent as
  init; 2 by default, room for a command). File descriptors: the system-wide
  ``file-max`` over a sandbox's, and the edge's own ``RLIMIT_NOFILE`` over the fds the
  edge holds per idle sandbox (measured: 1, the seccomp listener's notify fd, which is
  also the death watch and carries pid 1's doorbell for signal reports,
  dsec.backends.container.initwatch; ``DSEC_SANDBOX_EDGE_FDS``; root here cannot
  raise a hard rlimit, 20,000). The smallest of these is the sandbox-count limit, and
  the resource that set it is reported. On this host (pid_max 32,768, nofile 20,000,
  24 GiB) that is 13,494, set by memory (the pids would allow 14,745, the edge's fds
  18,976; at 2 fds a sandbox they allowed 9,488).
* **use**: ``MemAvailable`` and the host's memory pressure stall information (PSI,
  ``/proc/pressure/memory``). cgroup v1 has no per-cgroup PSI, so the host's is used on
  every layout: it is what says the host as a whole is short, whatever the sandboxes'
  limits sum to.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
PROC = Path("/proc")
SYS = Path("/sys")


@dataclass(frozen=True)
class Pressure:
    """PSI of one resource: share of the last 10 s / 60 s some (or every) task stalled,
    in percent; None where the kernel has no PSI."""

    some_avg10: float
    some_avg60: float
    full_avg10: float


def read_pressure(name: str = "memory", proc: Path = PROC) -> Pressure | None:
    try:
        text = (proc / "pressure" / name).read_text()
    except OSError:
        return None
    vals: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        fields: dict[str, float] = {}
        for f in rest.split():
            key, _, val = f.partition("=")
            with contextlib.suppress(ValueError):
                fields[key] = float(val)
        vals[kind] = fields
    some, full = vals.get("some", {}), vals.get("full", {})
    return Pressure(some.get("avg10", 0.0), some.get("avg60", 0.0), full.get("avg10", 0.0))


def meminfo(proc: Path = PROC) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                with contextlib.suppress(ValueError):
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def mem_available(proc: Path = PROC) -> int:
    """MemAvailable in bytes (0 if unreadable): the one line, not all of meminfo (this
    is read on every create)."""
    with contextlib.suppress(OSError, ValueError):
        text = (proc / "meminfo").read_text()
        at = text.find("\nMemAvailable:")
        if at >= 0:
            return int(text[at + 14 : text.index("\n", at + 1)].split()[0]) * 1024
    return 0


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: Superblocks the host has outside any sandbox (its own mounts, other containers): an
#: allowance in the shrinker-map arithmetic, small against 5 a sandbox.
HOST_SHRINKER_IDS = 1024


def shrinker_slot_bytes(release: str | None = None, sysfs: Path = SYS) -> int:
    """Bytes one shrinker id costs every memory cgroup (mm/shrinker.c): since Linux 6.7 a
    520-byte unit in kmalloc-1k per 64 ids, 16 B an id; from 4.19 a bitmap bit plus an
    ``nr_deferred`` long, ~8 B; before 4.19 no per-memcg map at all. One map per NUMA
    node."""
    if release is None:
        release = os.uname().release
    try:
        major, minor = (int(part) for part in release.split(".")[:2])
    except ValueError:
        major, minor = 6, 7  # unparsable: assume the costlier layout
    per_node = 16 if (major, minor) >= (6, 7) else 8 if (major, minor) >= (4, 19) else 0
    return per_node * _numa_nodes(sysfs)


def _numa_nodes(sysfs: Path) -> int:
    """Online NUMA nodes ("0", "0-1", "0,2-3"; 1 where there is no such file)."""
    try:
        text = (sysfs / "devices/system/node/online").read_text().strip()
    except OSError:
        return 1
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        with contextlib.suppress(ValueError):
            count += int(hi or lo) - int(lo) + 1
    return max(1, count)


@dataclass(frozen=True)
class SandboxCost:
    """What one idle sandbox costs of each finite host resource (settings, with the
    measured defaults of the module doc)."""

    host_memory_bytes: int = 704 * 1024
    """Host memory of one idle sandbox apart from its memory cgroup's shrinker map."""
    superblocks: int = 5
    """A container sandbox's own superblocks: overlay root, proc, /dev tmpfs, devpts and
    its ipc namespace's mqueue (tests/test_sharedsys.py checks the count)."""
    tasks: int = 2
    files: int = 64
    edge_fds: int = 1
    shrinker_slot_bytes: int = field(default_factory=shrinker_slot_bytes)
    """What each shrinker id costs each memory cgroup on this host."""

    def memory_of(self, n: int) -> int:
        """Host memory ``n`` idle sandboxes cost together: each its own part, and a
        memory cgroup whose shrinker map has a slot for every superblock of all ``n``
        and of the host."""
        ids = HOST_SHRINKER_IDS + self.superblocks * n
        return n * (self.host_memory_bytes + self.shrinker_slot_bytes * ids)

    def one_more(self, n: int) -> int:
        """Host memory the next sandbox costs with ``n`` present: its own part, its map,
        and a slot more in every other sandbox's map for each of its superblocks."""
        return self.memory_of(n + 1) - self.memory_of(n)

    def most_that_fit(self, budget: int) -> int:
        """The largest ``n`` whose ``memory_of(n)`` is within ``budget`` bytes."""
        a = self.shrinker_slot_bytes * self.superblocks
        b = self.host_memory_bytes + self.shrinker_slot_bytes * HOST_SHRINKER_IDS
        if budget <= 0 or b <= 0:
            return 0
        n = budget // b if a == 0 else (math.isqrt(b * b + 4 * a * budget) - b) // (2 * a)
        while self.memory_of(n + 1) <= budget:  # integer roots: settle on the exact n
            n += 1
        while n > 0 and self.memory_of(n) > budget:
            n -= 1
        return n


@dataclass(frozen=True)
class Capacity:
    """The sandbox-count limit and what each resource allows (``by``: which set it)."""

    max_sandboxes: int
    by: str
    limits: dict[str, int] = field(default_factory=dict)


def host_capacity(
    cost: SandboxCost,
    *,
    memory_reserve_bytes: int,
    proc: Path = PROC,
    nofile: int | None = None,
) -> Capacity:
    """The sandbox count each resource allows, and the smallest (module doc)."""
    total = meminfo(proc).get("MemTotal", 0)
    if nofile is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        nofile = hard if hard != resource.RLIM_INFINITY else soft
    # Tables the host itself uses too: a tenth of each is left to it.
    limits = {
        "memory": cost.most_that_fit(total - memory_reserve_bytes),
        "pids": _read_int(proc / "sys/kernel/pid_max", 32768) * 9 // 10 // max(1, cost.tasks),
        "threads": _read_int(proc / "sys/kernel/threads-max", 32768)
        * 9
        // 10
        // max(1, cost.tasks),
        "files": _read_int(proc / "sys/fs/file-max", 1 << 20) * 9 // 10 // max(1, cost.files),
        "edge_fds": max(0, nofile - 1024) // max(1, cost.edge_fds),
    }
    by = min(limits, key=lambda k: limits[k])
    return Capacity(max(1, limits[by]), by, limits)


def memory_reserve_bytes(total: int | None = None) -> int:
    """Memory admission keeps free for the host itself: 3% of RAM, at least 256 MiB, at
    most 2 GiB (the edge, the page cache of the layers, the kernel's own reserves)."""
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 * MiB, min(2048 * MiB, total * 3 // 100))
