"""Background work that restarts itself: no internal component dies for good.

A background task that raised used to stay dead until the platform restarted (the
seccomp listener after one ``EMFILE`` from ``accept``, which then failed every create
with "the seccomp listener is not running" long after the fds were free again). Here
every long-running task and thread of the platform is registered under a name:

* :meth:`Supervisor.spawn` runs a coroutine and, when it raises (or returns, which a
  loop never should), runs it again after a backoff that doubles up to
  ``max_backoff`` and starts over once it has run ``STABLE`` seconds;
* :meth:`Supervisor.watch` polls a thread-backed component's ``healthy()`` and calls
  its ``restart()`` with the same backoff.

A failure is logged once per streak (a traceback only for a failure that is not an
exhaustion, and only the first time), its recovery once, and :meth:`failures` lists
the components that are down or restarted recently, for ``/v1/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dsec.exhaustion import classify

log = logging.getLogger(__name__)

# A thread- or socket-backed part to ``watch``: its name, why it is down (None: it is
# fine), and how to restart it.
Watched = tuple[str, Callable[[], str | None], Callable[[], None]]

STABLE = 5.0  # seconds a restarted component must run before it counts as healthy
MIN_BACKOFF = 0.1
MAX_BACKOFF = 10.0


@dataclass
class Component:
    name: str
    restarts: int = 0
    down_since: float | None = None  # unix time of the first failure of this streak
    last_error: str = ""
    last_start: float = field(default_factory=time.monotonic)
    backoff: float = MIN_BACKOFF
    tracebacks: set[str] = field(default_factory=set)

    def healthy(self) -> bool:
        return self.down_since is None

    def failed(self, exc: BaseException | str) -> float:
        """Record a failure; the delay before the next start."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if time.monotonic() - self.last_start > STABLE:
            self.backoff = MIN_BACKOFF  # it ran a while: a new streak
        if self.down_since is None:
            self.down_since = time.time()
            kind = "" if isinstance(exc, str) else type(exc).__name__
            if (
                isinstance(exc, BaseException)
                and classify(exc) is None
                and kind not in (self.tracebacks)
            ):
                self.tracebacks.add(kind)
                log.error("%s died; restarting it", self.name, exc_info=exc)
            else:
                log.warning("%s died (%s); restarting it with backoff", self.name, text[:300])
        self.last_error = text[:300]
        delay = self.backoff
        self.backoff = min(MAX_BACKOFF, self.backoff * 2)
        return delay

    def started(self) -> None:
        self.restarts += 1 if self.down_since is not None else 0
        self.last_start = time.monotonic()

    def stable(self) -> None:
        if self.down_since is not None:
            log.warning(
                "%s is running again (down %.1fs)",
                self.name,
                max(0.0, time.time() - self.down_since),
            )
            self.down_since = None


async def _keep(comp: Component, factory: Callable[[], Awaitable[None]]) -> None:
    while True:
        comp.started()
        runner = asyncio.ensure_future(factory())
        settle = asyncio.get_running_loop().call_later(STABLE, comp.stable)
        try:
            await runner
            delay = comp.failed("returned; a background loop must not end")
        except asyncio.CancelledError:
            runner.cancel()
            raise
        except Exception as exc:
            delay = comp.failed(exc)
        finally:
            settle.cancel()
        await asyncio.sleep(delay)


# Loops owned by parts that have no supervisor at hand (a backend, a pool): restarted
# the same way, and listed by every Supervisor's failures().
_loose: dict[str, Component] = {}


async def keep_running(name: str, factory: Callable[[], Awaitable[None]]) -> None:
    """Run ``factory()`` until cancelled, restarting it with backoff when it fails;
    wrap it in a task where a bare ``create_task(loop())`` would die for good."""
    comp = _loose.setdefault(name, Component(name))
    try:
        await _keep(comp, factory)
    finally:
        if _loose.get(name) is comp:
            del _loose[name]


class Supervisor:
    """Owns the platform's background tasks and watched threads."""

    def __init__(self) -> None:
        self.components: dict[str, Component] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run ``factory()`` as ``name`` until :meth:`close`, restarting it on failure."""
        comp = self.components.setdefault(name, Component(name))
        self._tasks.append(asyncio.create_task(self._keep(comp, factory), name=name))

    def watch(
        self,
        name: str,
        healthy: Callable[[], str | None],
        restart: Callable[[], None],
        *,
        interval: float = 0.5,
    ) -> None:
        """Poll ``healthy()`` (None: fine, else why not) and ``restart()`` when not."""
        comp = self.components.setdefault(name, Component(name))
        self._tasks.append(
            asyncio.create_task(self._poll(comp, healthy, restart, interval), name=f"{name}-watch")
        )

    async def _keep(self, comp: Component, factory: Callable[[], Awaitable[None]]) -> None:
        await _keep(comp, factory)

    async def _poll(
        self,
        comp: Component,
        healthy: Callable[[], str | None],
        restart: Callable[[], None],
        interval: float,
    ) -> None:
        next_try = 0.0
        while True:
            await asyncio.sleep(interval)
            try:
                why = healthy()
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                if comp.down_since is not None and time.monotonic() - comp.last_start > STABLE:
                    comp.stable()
                continue
            if time.monotonic() < next_try:
                continue
            delay = comp.failed(why)
            comp.started()
            try:
                restart()
            except Exception as exc:
                delay = comp.failed(exc)
            next_try = time.monotonic() + delay

    @property
    def generation(self) -> int:
        """How many restarts the platform's components have had, in all: a thing made
        before one (e.g. a warm sandbox whose seccomp notify fd a restarted listener no
        longer holds, dsec.edge.warmpool) may lack what a thing made after it gets."""
        return sum(c.restarts for c in [*self.components.values(), *_loose.values()])

    def failures(self) -> list[dict[str, str | float | int]]:
        """Components that are down or not yet stable again, for ``/v1/health``."""
        return [
            {
                "component": c.name,
                "since": round(c.down_since, 3),
                "reason": c.last_error,
                "restarts": c.restarts,
            }
            for c in [*self.components.values(), *_loose.values()]
            if c.down_since is not None
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
