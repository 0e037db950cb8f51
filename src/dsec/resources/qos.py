"""CPU QoS classes: how a sandbox's processes compete for the host's cores.

Two classes (``DSecRunArgs.qos``):

- ``latency`` (the default): interactive and tool-calling sandboxes, where every
  command's round trip is on someone's critical path. Normal scheduling (SCHED_OTHER)
  and a high CPU weight, so under contention they get the cores first; and, where the
  kernel has core scheduling, a core-scheduling cookie of their own, so that no other
  sandbox's task runs on the sibling hyperthread at the same time.
- ``best_effort``: batch work that only needs throughput (builds, test suites, RL
  rollouts nobody waits on). Every process at SCHED_IDLE (it runs when a core would
  otherwise idle) and the lowest CPU weight; where the kernel has cgroup ``cpu.idle``
  (>= 5.15), the sandbox's cgroup is an idle entity too, because a task's SCHED_IDLE
  only ranks it within its own cgroup while the scheduler compares sibling sandboxes
  as cgroup entities (bench/bench_qos.py, both cores busy: the loop's mean +0.3% over
  an unloaded host with the idle cgroup, +55% without it). The policy is set on the
  sandbox's init from the host right after it starts, and every process it forks
  inherits it. A sandbox cannot leave it: that needs CAP_SYS_NICE or an RLIMIT_NICE
  that permits it (sched(7)), and sandboxes have neither (``NICE_RLIMIT``).

Why SCHED_IDLE and not the lowest weight alone, measured in the same bench: with the
weight alone the loop is 4-5x slower on a full host (EEVDF lets the running entity
finish its slice, and a weight only counts among siblings), as without QoS. The price:
the kernel counts a core running only SCHED_IDLE work as idle when it places a waking
task (``sched_idle_cpu``), so with one core left free the loop's tasks queue on the
burner's core and the p99 grows by about a tick (README, Benchmarks, bench_qos).

The weights are OCI ``cpu.shares`` values (cgroup v1 ``cpu.shares``; crun converts
them to v2 ``cpu.weight``): they only matter between siblings, and a sandbox's
siblings are the edge's other sandboxes: under contention a latency sandbox weighs
4x a default-weight sibling and 2048x a best-effort one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterable
from functools import cache
from typing import Literal

from dsec.resources import oom
from dsec.resources.cgroups import v2_weight

#: The classes (the wire's ``DSecRunArgs.qos``; dsec.api does not import this module).
QoS = Literal["latency", "best_effort"]

#: cgroup v1 cpu.shares (the OCI ``linux.resources.cpu.shares``) per class. 1024 is
#: the kernel's default; 2 is v1's minimum (v2 weight 1 after crun's conversion).
CPU_SHARES: dict[str, int] = {"latency": 4096, "best_effort": 2}

#: RLIMIT_NICE of every sandbox process (hard and soft): 0 lets no process raise its
#: priority, so none can leave SCHED_IDLE (sched(7): that needs CAP_SYS_NICE or a nice
#: ceiling from RLIMIT_NICE).
NICE_RLIMIT = 0

# prctl(2) core scheduling (linux/prctl.h, kernel >= 5.14 with CONFIG_SCHED_CORE).
PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PR_SCHED_CORE_CREATE = 1
PIDTYPE_TGID = 1


def cpu_shares(qos: str) -> int:
    """The cgroup CPU weight (as v1 shares) of class ``qos``."""
    return CPU_SHARES[qos]


def cgroup_v2_weight(shares: int) -> int:
    """The v2 cpu.weight a class's shares become (crun's conversion, which
    CgroupHost.create_limited uses too)."""
    return v2_weight(shares)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@cache
def core_scheduling() -> str | None:
    """None when this kernel has core scheduling (PR_SCHED_CORE), else why not. Asked
    once: a PR_SCHED_CORE_GET on ourselves fails with EINVAL without CONFIG_SCHED_CORE
    (and on kernels older than 5.14, which do not know the prctl)."""
    cookie = ctypes.c_ulong(0)
    rc = _libc().prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_TGID, ctypes.byref(cookie))
    if rc == 0:
        return None
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return "kernel without core scheduling (CONFIG_SCHED_CORE)"
    if err == errno.ENODEV:
        return "core scheduling off: the CPU has no SMT siblings"
    return f"core scheduling unavailable: {os.strerror(err)}"


def health_detail() -> dict[str, str]:
    """What /v1/health's backend details say about QoS on this host."""
    why_not = core_scheduling()
    return {
        "core_scheduling": "on" if why_not is None else f"off: {why_not}",
        **oom.health_detail(),
    }


def give_core_cookie(pid: int) -> bool:
    """A core-scheduling cookie of its own for ``pid``'s thread group (its future
    children inherit it), where the kernel has core scheduling; False where not."""
    if core_scheduling() is not None:
        return False
    rc = _libc().prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PIDTYPE_TGID, 0)
    return bool(rc == 0)


def threads_of(pid: int) -> list[int]:
    """Every thread id of process ``pid`` (empty if it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError):
        return []


def set_idle(pids: Iterable[int]) -> int:
    """Put every thread of every process in ``pids`` at SCHED_IDLE; what they fork from
    now on inherits it. The main thread first, then the others, again until a pass
    finds no thread it has not set: a thread started meanwhile by one not yet set (a
    QEMU starting its vCPU threads) is caught by the next pass. Returns how many
    threads were set (gone ones skipped)."""
    done: set[int] = set()
    for pid in pids:
        todo = [pid]
        while todo:
            for tid in todo:
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                done.add(tid)
            todo = [t for t in threads_of(pid) if t not in done]
    return len(done)


def acts_on(qos: str) -> bool:
    """Whether class ``qos`` needs ``apply`` on a new sandbox's processes here (a
    latency sandbox needs nothing but its weight where there is no core scheduling)."""
    return qos == "best_effort" or core_scheduling() is None


def apply(qos: str, pids: Iterable[int]) -> None:
    """Apply class ``qos``'s scheduling to processes the platform just started (the
    cgroup weight is the caller's: it is set where the cgroup is made)."""
    pids = list(pids)
    if qos == "best_effort":
        set_idle(pids)
    elif qos == "latency":
        for pid in pids:
            give_core_cookie(pid)


def policy_of(pid: int) -> int:
    """The scheduling policy of ``pid`` (os.SCHED_*), for tests and stats."""
    return os.sched_getscheduler(pid)
