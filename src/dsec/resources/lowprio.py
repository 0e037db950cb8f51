"""Threads at a lower CPU priority, for work that must not take the cores from creates.

A sandbox's teardown (SIGKILL and wait, reclaiming the pages still charged to its
memory cgroup, removing the cgroups, deleting its btrfs subvolume and quota group, the
directory) costs several ms of CPU, much of it kernel work done in the calling thread.
On a 2-core host a teardown that runs beside the next create (an RL loop stops one
sandbox and creates the next; a trainer stops a batch while another is created) took
those cores at the same weight as the create. Here it runs on its own threads (it
does not queue the create's own ``to_thread`` work behind it either), each niced by
``NICE`` (Linux: the nice value is per thread): weight 110 against 1024, so a create
wins the core ~9:1 and a teardown still finishes under load. Not SCHED_IDLE: a
thread of that class holding a kernel lock (btrfs's transaction, the cgroup mutex)
while CPU-bound sandboxes run could stall the creates waiting on that lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# How much nicer than the process the pool's threads run (nice 19 is the lowest).
NICE = 10


def _lower_priority(nice: int) -> None:
    """Runs first on each pool thread: that thread (only) ``nice`` steps nicer."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # best effort: a plain thread still works
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class LowPriorityPool:
    """``await pool.run(fn, *args)``: ``fn`` on one of ``workers`` threads, ``nice``
    steps nicer than the process."""

    def __init__(self, name: str, *, workers: int = 4, nice: int = NICE) -> None:
        self.name = name
        self.workers = workers
        self.nice = nice
        self._pool: ThreadPoolExecutor | None = None  # made on first use, again after close

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.workers,
                thread_name_prefix=self.name,
                initializer=_lower_priority,
                initargs=(self.nice,),
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Wait for the work in flight, then end the threads (a later run starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
