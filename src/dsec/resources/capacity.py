"""What this host can hold, measured rather than assumed: admission's inputs.

Two kinds of figure, both read from /proc (a few file reads, no syscall loop):

* **capacity**: how many sandboxes the host's finite tables allow, each divided by what
  one idle sandbox costs of it. Memory: ``MemTotal`` (less a reserve for the host) over
  the host memory an idle sandbox costs (kernel memory of its cgroups, namespaces and
  mounts plus its processes; 0.59-1.44 MiB measured here for idle busybox sandboxes,
  issue 19, so 1.5 MiB by default, ``DSEC_SANDBOX_HOST_COST_KB``). Tasks: ``pid_max``
  and ``threads-max`` over the tasks of an idle sandbox (measured: 1, its agent as
  init; 2 by default, room for a command). File descriptors: the system-wide
  ``file-max`` over a sandbox's, and the edge's own ``RLIMIT_NOFILE`` over the fds the
  edge holds per idle sandbox (measured: 1, the seccomp listener's notify fd, which is
  also the death watch and carries pid 1's doorbell for signal reports,
  dsec.backends.container.initwatch; ``DSEC_SANDBOX_EDGE_FDS``; root here cannot
  raise a hard rlimit, 20,000). The smallest of these is the sandbox-count limit, and
  the resource that set it is reported. On this host (pid_max 32,768, nofile 20,000,
  24 GiB) that is 14,745, set by the pids (the edge's fds would allow 18,976; at 2
  fds a sandbox they allowed 9,488).
* **use**: ``MemAvailable`` and the host's memory pressure stall information (PSI,
  ``/proc/pressure/memory``). cgroup v1 has no per-cgroup PSI, so the host's is used on
  every layout: it is what says the host as a whole is short, whatever the sandboxes'
  limits sum to.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
PROC = Path("/proc")


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


@dataclass(frozen=True)
class SandboxCost:
    """What one idle sandbox costs of each finite host resource (settings, with the
    measured defaults of the module doc)."""

    host_memory_bytes: int = 3 * MiB // 2
    tasks: int = 2
    files: int = 64
    edge_fds: int = 1


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
        "memory": max(0, total - memory_reserve_bytes) // max(1, cost.host_memory_bytes),
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
