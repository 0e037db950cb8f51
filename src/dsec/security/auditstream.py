"""Following the audit log live: the frames of ``GET /v1/events/stream``.

The log is SQLite with ``seq`` as its key, so a follower is a cursor: it asks for the
rows after the last one it sent (the same query as ``/v1/audit``), sends them, and
when there are none waits until the log says something was written (or a short poll
interval passes: rows written in another thread are seen within it). A reconnecting
client resumes exactly where it stopped (``Last-Event-ID``); nothing is buffered per
client beyond one page.

Every string a sandbox influences (commands, paths, hostnames) is inside the JSON
``data`` line, where newlines are escaped: no record can end its frame early or
forge another event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from dsec.api.events import AuditKind, AuditRecord
from dsec.security.audit import AuditLog, Filters

PAGE = 500
POLL = 1.0  # seconds a follower waits for a write before it looks for a disconnect
KEEPALIVE = 15.0  # a comment line, so proxies and clients see a live connection


def frame(record: AuditRecord, event_id: str | None = None) -> str:
    """One SSE frame; ``id`` is the record's seq unless given (a cluster's stream sends
    its cursor over every edge: dsec.cluster.fanout)."""
    eid = str(record.seq) if event_id is None else event_id
    return f"id: {eid}\nevent: {record.kind.value}\ndata: {record.model_dump_json()}\n\n"


class AuditFollower:
    """One client's position in the log and the filters it asked for."""

    def __init__(
        self, audit: AuditLog, filters: Filters, kinds: list[AuditKind], cursor: int
    ) -> None:
        self.audit = audit
        self.kinds = kinds
        self.filters: Filters = {k: v for k, v in filters.items() if k != "limit"}  # type: ignore[assignment]
        self.cursor = cursor

    def page(self) -> list[AuditRecord]:
        f: Filters = {**self.filters, "since_seq": self.cursor, "limit": PAGE}
        return self.audit.records(kinds=self.kinds, **f)

    async def frames(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        quiet_since = time.monotonic()
        yield ": dsec audit stream\n\n"  # the headers go out now, not with the first row
        while True:
            rows = await asyncio.to_thread(self.page)
            for record in rows:
                self.cursor = record.seq
                yield frame(record)
            if rows:
                quiet_since = time.monotonic()
                continue
            if await disconnected():
                return
            if time.monotonic() - quiet_since >= KEEPALIVE:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            await self.audit.wait_for_write(POLL)
