"""Teardowns that failed are tried again until they succeed.

Why: a teardown can fail for a reason that passes (the edge out of file descriptors,
memory or pids for a moment: dsec.exhaustion). The sandbox is recorded as failed with
"teardown incomplete", but its cgroups, mounts, directory and runtime state are still
on the host; without another try they would stay until the next start's sweep, which
may be weeks away. Backend.destroy is idempotent and works on half-removed sandboxes,
so trying it again is always safe. The edge's loop tries every few seconds; close tries
once more while the backends are still open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from dsec.backends.base import SandboxRecord
from dsec.errors import DSecError

log = logging.getLogger(__name__)

Destroy = Callable[[SandboxRecord], Awaitable[None]]
Done = Callable[[SandboxRecord, int], None]


class UnfinishedTeardowns:
    """Records whose backend teardown failed; ``destroy(rec)`` tries again,
    ``done(rec, attempts)`` is told once one succeeded."""

    def __init__(self, destroy: Destroy, done: Done) -> None:
        self._destroy = destroy
        self._done = done
        self._pending: dict[str, tuple[SandboxRecord, int]] = {}

    def add(self, rec: SandboxRecord) -> None:
        """``rec``'s teardown failed once."""
        _, tries = self._pending.get(rec.id, (rec, 0))
        self._pending[rec.id] = (rec, tries + 1)

    def __len__(self) -> int:
        return len(self._pending)

    async def retry(self) -> int:
        """Try each pending teardown once more; returns how many are still pending."""
        for sid, (rec, tries) in list(self._pending.items()):
            try:
                await self._destroy(rec)
            except DSecError as exc:
                tries += 1
                self._pending[sid] = (rec, tries)
                if tries in (2, 10, 100):  # said now and then, not every tick
                    log.warning("teardown of %s still incomplete (%d tries): %s", sid, tries, exc)
                continue
            except Exception:  # a bug in a backend: said, and tried again
                log.exception("teardown of %s failed unexpectedly", sid)
                self._pending[sid] = (rec, tries + 1)
                continue
            if self._pending.pop(sid, None) is not None:
                self._done(rec, tries + 1)
        return len(self._pending)

    async def loop(self, every: float = 2.0) -> None:
        while True:
            await asyncio.sleep(every)
            if self._pending:
                await self.retry()
