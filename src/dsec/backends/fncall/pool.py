"""A warm pool: ready FnCall sandboxes of one (image, limits), sized by demand.

Sizing: ``target`` is how many sandboxes we keep ready. A miss (a call found none
ready) doubles it, up to ``max_ready`` and the host-wide budget; every ``shrink_s``
without a miss it halves towards the peak number of calls in flight in that window
(and ``min_ready``), and surplus ready sandboxes are destroyed. Each call consumes its
sandbox (destroyed after the call) and is replaced right away in the background, so
a steady load keeps ``target`` ready ahead of it.

Priority (``idle``): building is background work at SCHED_IDLE (see zygote.c), except
while a call or a warm-up waits for a sandbox; a sandbox runs at normal priority from
the moment a call takes it until it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.api.fncall import DSecFnCallRunArgs
from dsec.backends.fncall.zygote import CgroupPlan, Runner, Zygote
from dsec.errors import AdmissionRejected, BackendError
from dsec.supervise import keep_running

log = logging.getLogger(__name__)


@dataclass
class Budget:
    """Host-wide cap on FnCall sandboxes (ready + starting + in use + dying)."""

    limit: int
    used: int = 0

    def take(self, want: int) -> int:
        n = max(0, min(want, self.limit - self.used))
        self.used += n
        return n

    def give(self, n: int = 1) -> None:
        self.used = max(0, self.used - n)


class WarmPool:
    def __init__(
        self,
        key: str,
        zygote_factory: Callable[[WarmPool], Zygote],
        plan: CgroupPlan,
        budget: Budget,
        *,
        min_ready: int = 2,
        max_ready: int = 64,
        shrink_s: float = 2.0,
        args: DSecFnCallRunArgs | None = None,
        idle: bool = False,
    ) -> None:
        self.key = key
        self.args = args or DSecFnCallRunArgs()
        self.plan = plan
        self.budget = budget
        self.min_ready = min_ready
        self.max_ready = max_ready
        self.shrink_s = shrink_s
        self.idle = idle
        self._urgent = 0  # calls and warm-ups waiting for a sandbox (see ``idle``)
        self.zygote = zygote_factory(self)
        self.ready: deque[Runner] = deque()
        self.waiters: deque[asyncio.Future[Runner]] = deque()
        self.starting = 0  # asked of the zygote, not ready yet
        self.alive = 0  # sandboxes the zygote has not reported gone (budget held)
        self.in_use = 0
        self.target = min_ready
        self.created = 0
        self.destroyed = 0
        self.misses = 0
        self.failures = 0
        self.last_error = ""
        self.last_used = time.monotonic()
        self.warm_s: float | None = None
        self._peak_in_use = 0
        self._missed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._shrinker: asyncio.Task[None] | None = None
        self._ready_changed = asyncio.Event()
        self.closed = False

    async def start(self) -> None:
        await self.zygote.start()
        self._shrinker = asyncio.create_task(
            keep_running(f"fncall-pool-{self.key}-shrink", self._shrink_loop)
        )
        self.refill()

    # -- zygote callbacks ------------------------------------------------------------

    def on_spawned(
        self, sid: int, name: str, sock: socket.socket, pid: int = 0, base_memory: int = 0
    ) -> None:
        runner = Runner(sid, name, sock, pid, base_memory)
        runner.idle = self.idle
        task = asyncio.create_task(self._await_ready(runner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_ready(self, runner: Runner) -> None:
        try:
            await asyncio.wait_for(runner.wait_ready(), 10)
        except Exception as exc:  # any failure (StopIteration too): counted, never sticky
            # An unexpected exception used to escape here with ``starting`` never
            # decremented, so the pool believed runners were on their way and never
            # refilled: every call then waited for a runner that would not come.
            self.starting -= 1
            self.failures += 1
            self.last_error = f"sandbox setup failed ({exc!r}): {self.zygote.log_tail()}"
            log.warning("fncall pool %s: %s", self.key, self.last_error)
            runner.close()
            self.zygote.kill(runner.id)
            if self.failures >= 5 and self.created == 0:
                self._fail_waiters(BackendError(self.last_error))
            return
        self.starting -= 1
        self.created += 1
        if self.closed:
            runner.close()
            return
        runner.oom_kills = self.oom_kills(runner)  # here, not on the call's path
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(runner)
                return
        self.ready.append(runner)
        self._ready_changed.set()

    def on_gone(self, sid: int) -> None:
        self.alive -= 1
        self.destroyed += 1
        self.budget.give()
        if not self.closed:
            self.refill()

    def on_error(self, message: str) -> None:
        self.last_error = message
        log.warning("fncall pool %s: %s", self.key, message)
        if "zygote exited" in message:
            self._fail_waiters(BackendError(f"FnCall pool {self.key} is down: {message}"))
        else:
            # A sandbox the zygote could not build: its budget was taken for nothing.
            self.starting -= 1
            self.alive -= 1
            self.budget.give()
            self.failures += 1

    def _fail_waiters(self, exc: Exception) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(exc)

    # -- sizing ----------------------------------------------------------------------

    def refill(self) -> None:
        """Ask the zygote for what keeps ``target`` ready (and the waiters served)."""
        if self.closed or not self.zygote.alive:
            return
        want = self.target + len(self.waiters) - len(self.ready) - self.starting
        n = self.budget.take(want) if want > 0 else 0
        if n:
            self.starting += n
            self.alive += n
            self.zygote.spawn(n)

    def grow(self, to: int) -> None:
        self.target = max(self.target, min(self.max_ready, to))
        self.refill()

    async def _shrink_loop(self) -> None:
        while True:
            await asyncio.sleep(self.shrink_s)
            if self._missed:
                self._missed = False
            else:
                floor = max(self.min_ready, self._peak_in_use)
                self.target = max(floor, self.target // 2) if self.target > floor else floor
                while len(self.ready) > self.target:
                    self.ready.pop().close()
            self._peak_in_use = self.in_use

    def _wait_urgently(self, delta: int) -> None:
        was = self._urgent > 0
        self._urgent += delta
        if self.idle and was != (self._urgent > 0):
            self.zygote.urgent(self._urgent > 0)

    # -- calls -----------------------------------------------------------------------

    async def acquire(self, timeout: float = 30.0) -> tuple[Runner, bool]:
        """A ready sandbox (and whether it was ready without waiting)."""
        if self.closed or not self.zygote.alive:
            raise BackendError(f"FnCall pool {self.key} is down: {self.last_error}")
        self.last_used = time.monotonic()
        self.in_use += 1
        self._peak_in_use = max(self._peak_in_use, self.in_use)
        try:
            if self.ready:
                runner, warm = self.ready.popleft(), True
            else:
                self.misses += 1
                self._missed = True
                self.target = min(self.max_ready, max(self.target * 2, self.in_use + 1))
                fut: asyncio.Future[Runner] = asyncio.get_running_loop().create_future()
                self.waiters.append(fut)
                self.refill()
                self._wait_urgently(1)
                try:
                    runner = await asyncio.wait_for(fut, timeout)
                except TimeoutError:
                    raise AdmissionRejected(
                        f"no FnCall sandbox became ready within {timeout:.0f}s "
                        f"(pool {self.key}: {self.alive} alive, host budget "
                        f"{self.budget.used}/{self.budget.limit}); retry later"
                    ) from None
                finally:
                    self._wait_urgently(-1)
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(fut)
                warm = False
        except BaseException:
            self.in_use -= 1
            raise
        runner.activate()
        self.refill()
        return runner, warm

    def release(self, runner: Runner) -> None:
        """The call is over: destroy its sandbox (the zygote replaces it)."""
        self.in_use -= 1
        self.last_used = time.monotonic()
        runner.close()

    async def warm(self, size: int, timeout: float) -> float:
        """Raise the target to ``size`` and wait until that many are ready."""
        t0 = time.perf_counter()
        self.target = min(self.max_ready, size)
        if self.target < size:
            self.max_ready = size
            self.target = size
        self.refill()
        deadline = time.monotonic() + timeout
        self._wait_urgently(1)
        try:
            while len(self.ready) < self.target:
                self._ready_changed.clear()
                left = deadline - time.monotonic()
                if left <= 0 or not self.zygote.alive:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ready_changed.wait(), left)
        finally:
            self._wait_urgently(-1)
        self._missed = True  # do not shrink what was just asked for
        self.warm_s = time.perf_counter() - t0
        return self.warm_s

    def sandbox_cgroup(self, runner: Runner) -> Path | None:
        return self.plan.memory_dir / runner.name if self.plan.memory_dir else None

    def _read(self, runner: Runner, name: str) -> bytes:
        """One file of the sandbox's memory cgroup (b"" if unreadable): raw os calls,
        on the call's path twice (pathlib's read_text cost ~50 us each)."""
        d = self.plan.memory_dir
        if d is None:
            return b""
        try:
            fd = os.open(f"{d}/{runner.name}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return b""
        try:
            return os.read(fd, 4096)
        except OSError:
            return b""
        finally:
            os.close(fd)

    def oom_kills(self, runner: Runner) -> int:
        """OOM kills in the sandbox's memory cgroup so far (its slot may be reused)."""
        text = self._read(runner, "memory.events" if self.plan.v2 else "memory.oom_control")
        for line in text.splitlines():
            k, _, v = line.partition(b" ")
            if k == b"oom_kill":
                with contextlib.suppress(ValueError):
                    return int(v)
        return 0

    def peak_memory(self, runner: Runner) -> int:
        """Peak charge of the sandbox's memory cgroup above what a reused one had charged
        before it (shared page cache; see zygote.c)."""
        text = self._read(runner, "memory.peak" if self.plan.v2 else "memory.max_usage_in_bytes")
        try:
            return max(0, int(text) - runner.base_memory)
        except ValueError:
            return 0

    async def close(self) -> None:
        self.closed = True
        if self._shrinker is not None:
            self._shrinker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shrinker
        self._fail_waiters(BackendError(f"FnCall pool {self.key} is closing"))
        while self.ready:
            self.ready.pop().close()
        for task in list(self._tasks):
            task.cancel()
        await self.zygote.close()
        self.budget.give(max(0, self.alive))
        self.alive = 0
        for d in self.plan.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
