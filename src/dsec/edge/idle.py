"""Idle memory reclaim: sandboxes nobody uses give their memory back, before any
create is refused for want of it (issue 19, items 2 and 3).

*Idle* is the edge's own clock of data-path activity (``SandboxRecord.last_activity``,
touched by every exec, file, session and process request and by streams, the clock
the idle TTL uses, dsec.edge.ttl). Three things happen:

* **cold reclaim**: a running sandbox idle for ``idle_seconds`` gives back its page
  cache and reclaimable slab once per idle period (the backend's ``reclaim_idle``:
  v2 ``memory.reclaim`` of the inactive bytes, v1 ``force_empty``; anonymous memory
  stays, running sandboxes are kept off swap).
* **pressure reclaim**: while the host's memory PSI ("some" avg10) is at or above
  ``pressure_limit``, the longest idle sandboxes (idle at least ``pressure_idle``
  seconds) push their anonymous memory to swap too, a few per tick, longest idle first.
* **make room**: admission found the host short by use (dsec.edge.admission); before
  it refuses, the edge awaits ``make_room(bytes)``, which does the same as pressure
  reclaim until that many bytes came back or ``room_timeout`` passed.

No per-tick scan of every sandbox: sandboxes sit in a heap ordered by when they may
next be idle long enough (pushed at create, adoption and thaw); a tick pops only those
that are due, and one still in use is pushed back at its new deadline. Only make-room
and pressure reclaim sort the running sandboxes, and only while the host is short.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dsec.api.sandbox import SandboxState
from dsec.errors import Unsupported
from dsec.resources.capacity import Pressure, mem_available, read_pressure
from dsec.resources.reclaim import swap_available

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.edge.edge import Edge

log = logging.getLogger(__name__)

# Reclaims in flight at once: each is kernel CPU (or the swap disk) for tens of ms.
CONCURRENCY = 2
PRESSURE_BATCH = 4  # sandboxes pushed to swap per tick while the host is under pressure


class IdleReclaimer:
    """Owned by the Edge; ``loop`` is supervised, ``track`` is its only hook."""

    def __init__(
        self,
        edge: Edge,
        *,
        idle_seconds: float,
        pressure_limit: float,
        pressure_idle: float = 30.0,
        room_timeout: float = 2.0,
    ) -> None:
        self.edge = edge
        self.idle_seconds = idle_seconds
        self.pressure_limit = pressure_limit
        self.pressure_idle = pressure_idle
        self.room_timeout = room_timeout
        self.tick = max(0.5, min(5.0, idle_seconds / 4)) if idle_seconds > 0 else 5.0
        self.read_pressure: Callable[[], Pressure | None] = read_pressure
        self.read_available: Callable[[], int] = mem_available
        self.swap_ok: Callable[[], bool] = swap_available
        self._heap: list[tuple[float, str]] = []
        self._queued: set[str] = set()
        # last_activity at the sandbox's last reclaim (cold, or with anon): not again
        # until it has been used
        self._cold: dict[str, float] = {}
        self._anon: dict[str, float] = {}
        self._slots = asyncio.Semaphore(CONCURRENCY)
        # cumulative, for metrics
        self.reclaims = 0
        self.reclaimed_bytes = 0
        self.pressure_reclaims = 0

    # -- the hook -----------------------------------------------------------------------
    def track(self, rec: SandboxRecord) -> None:
        """Consider ``rec`` from now on (create, adoption, thaw); idempotent."""
        if self.idle_seconds <= 0 or rec.id in self._queued:
            return
        self._queued.add(rec.id)
        heapq.heappush(self._heap, (rec.last_activity + self.idle_seconds, rec.id))

    def track_id(self, sandbox_id: str) -> None:
        rec = self.edge.find(sandbox_id)
        if rec is not None:
            self.track(rec)

    # -- the loop -----------------------------------------------------------------------
    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                await self.pass_once()
            except Exception:
                log.exception("idle reclaim pass failed")

    async def pass_once(self, now: float | None = None) -> list[str]:
        """Cold-reclaim the sandboxes that are due; under pressure, push the longest
        idle to swap. The ids reclaimed."""
        now = time.monotonic() if now is None else now
        due: list[SandboxRecord] = []
        while self._heap and self._heap[0][0] <= now:
            _, sid = heapq.heappop(self._heap)
            self._queued.discard(sid)
            rec = self.edge.find(sid)
            if rec is None or rec.state is not SandboxState.RUNNING:
                self._cold.pop(sid, None)
                self._anon.pop(sid, None)
                continue  # gone, or paused (a thaw tracks it again)
            if rec.last_activity + self.idle_seconds > now or self._cold.get(sid) == (
                rec.last_activity
            ):
                # used since, or reclaimed already this idle period: look again later
                self._queued.add(sid)
                heapq.heappush(self._heap, (max(rec.last_activity, now) + self.idle_seconds, sid))
                continue
            due.append(rec)
        done = await asyncio.gather(*(self._reclaim(rec, anon=False) for rec in due))
        for rec in due:
            self.track(rec)
        out = [rec.id for rec, freed in zip(due, done, strict=True) if freed is not None]
        psi = self.read_pressure()
        if psi is not None and psi.some_avg10 >= self.pressure_limit and self.swap_ok():
            out += await self._relieve(PRESSURE_BATCH, need=None, min_idle=self.pressure_idle)
        return out

    async def make_room(self, need: int) -> int:
        """Before admission refuses for memory: push idle sandboxes' memory out until
        ``need`` bytes came back (MemAvailable) or the time is up; bytes freed."""
        if need <= 0:
            return 0
        start = self.read_available()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._relieve(None, need=need, min_idle=min(self.pressure_idle, 10.0)),
                self.room_timeout,
            )
        return max(0, self.read_available() - start)

    async def _relieve(self, batch: int | None, *, need: int | None, min_idle: float) -> list[str]:
        now = time.monotonic()
        anon = self.swap_ok()
        seen = self._anon if anon else self._cold
        candidates = sorted(
            (
                r
                for r in self.edge.records_in({SandboxState.RUNNING})
                if now - r.last_activity >= min_idle and seen.get(r.id) != r.last_activity
            ),
            key=lambda r: r.last_activity,
        )
        if batch is not None:
            candidates = candidates[:batch]
        out: list[str] = []
        start = self.read_available()
        for rec in candidates:
            if need is not None and self.read_available() - start >= need:
                break
            freed = await self._reclaim(rec, anon=anon)
            if freed is not None:
                out.append(rec.id)
                self.pressure_reclaims += 1
        return out

    async def _reclaim(self, rec: SandboxRecord, *, anon: bool) -> int | None:
        """One sandbox; bytes freed (None: its backend cannot, or it went away)."""
        stamp = rec.last_activity
        try:
            backend = self.edge.backend_of(rec)
            async with self._slots:
                if rec.state is not SandboxState.RUNNING:
                    return None
                got = await backend.reclaim_idle(rec, anon=anon)
        except Unsupported:
            self._cold[rec.id] = stamp  # do not ask again this idle period
            return None
        except Exception as exc:  # a sandbox torn down meanwhile, a cgroup gone
            log.debug("idle reclaim of %s: %s", rec.id, exc)
            return None
        self._cold[rec.id] = stamp
        if anon:
            self._anon[rec.id] = stamp
        freed = max(0, (got.before or 0) - (got.after or 0))
        self.reclaims += 1
        self.reclaimed_bytes += freed
        return freed
