"""The audit log: every command, file operation and network decision, outside the sandbox.

It lives in its own SQLite file (WAL) under the edge's data directory, which is never
mounted into a sandbox. Writers only append to an in-memory batch (any thread: the
seccomp listener and the network log reader run beside the event loop); a flusher
writes the batch every ``flush_interval`` seconds in one transaction, so a command pays
a list append, not a disk write. A crash can lose at most the last unflushed batch.
Queries flush first, so a trainer never misses what already happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, Unpack

from dsec.exhaustion import classify

if TYPE_CHECKING:
    from dsec.supervise import Supervisor
from dsec.api.events import AuditKind, AuditRecord, EventKind, SecurityEvent, Severity

log = logging.getLogger(__name__)

# How severe each kind is unless its detector says otherwise.
DEFAULT_SEVERITY: dict[EventKind, Severity] = {
    EventKind.PROTECTED_PATH: Severity.CRITICAL,
    EventKind.DENIED_CONNECTION: Severity.WARNING,
    EventKind.HOST_ACCESS: Severity.CRITICAL,
    EventKind.SECCOMP_VIOLATION: Severity.CRITICAL,
    EventKind.BINARY_TAMPERING: Severity.WARNING,
    EventKind.RESOURCE_LIMIT: Severity.INFO,
    EventKind.ESCAPE_ATTEMPT: Severity.CRITICAL,
    EventKind.GRADED_LINK_ESCAPE: Severity.CRITICAL,
    EventKind.SCAN_INCOMPLETE: Severity.CRITICAL,
    EventKind.DETECTOR_ERROR: Severity.WARNING,
    EventKind.DNS_REBINDING: Severity.CRITICAL,
    EventKind.DNS_TUNNEL_SUSPECTED: Severity.CRITICAL,
    EventKind.SIGNAL_TO_INIT: Severity.CRITICAL,
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    sandbox TEXT NOT NULL,
    job TEXT,
    trajectory TEXT,
    kind TEXT NOT NULL,
    action TEXT NOT NULL,
    event TEXT,
    severity TEXT,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_sandbox ON audit(sandbox, seq);
CREATE INDEX IF NOT EXISTS audit_job ON audit(job, seq);
CREATE INDEX IF NOT EXISTS audit_event ON audit(event, seq) WHERE event IS NOT NULL;
CREATE TABLE IF NOT EXISTS tags (
    sandbox TEXT PRIMARY KEY,
    job TEXT,
    trajectory TEXT
);
"""

MAX_DETAIL_CHARS = 4096


class Filters(TypedDict, total=False):
    """What a query narrows by; ``since_seq`` is a cursor (rows with a greater seq)."""

    job_id: str | None
    sandbox_id: str | None
    trajectory_id: str | None
    since_seq: int
    limit: int


class AuditSink(Protocol):
    """What components that observe sandboxes write to (backends, network, seccomp)."""

    def record(self, sandbox_id: str, kind: AuditKind, action: str, **detail: Any) -> None: ...

    def event(
        self,
        sandbox_id: str,
        kind: EventKind,
        *,
        severity: Severity | None = None,
        **detail: Any,
    ) -> None: ...


@dataclass(frozen=True)
class _Row:
    seq: int
    ts: float
    sandbox: str
    job: str | None
    trajectory: str | None
    kind: str
    action: str
    event: str | None
    severity: str | None
    detail: str


def _clip(detail: dict[str, Any]) -> str:
    text = json.dumps(detail, default=str, separators=(",", ":"))
    if len(text) > MAX_DETAIL_CHARS:
        text = json.dumps({"truncated": text[: MAX_DETAIL_CHARS - 64]})
    return text


class AuditLog:
    """SQLite-backed audit log with batched writes; safe to call from any thread.
    ``path=None`` keeps it in memory (an edge used outside a platform, tests)."""

    def __init__(
        self,
        path: Path | None,
        *,
        flush_interval: float = 0.05,
        max_rows: int = 5_000_000,
    ) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.flush_interval = flush_interval
        self.max_rows = max_rows
        self._db = sqlite3.connect(
            path or ":memory:", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._db_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: list[_Row] = []
        (last,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()
        self._seq: int = int(last)
        self._tags: dict[str, tuple[str | None, str | None]] = {
            r[0]: (r[1], r[2])
            for r in self._db.execute("SELECT sandbox, job, trajectory FROM tags")
        }
        self._listeners: list[Callable[[SecurityEvent], None]] = []
        # Followers waiting for the next record (wait_for_write), under self._lock.
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._flusher: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the periodic flusher on the running event loop (under ``supervisor``
        when given: restarted if it ever dies)."""
        if supervisor is not None:
            supervisor.spawn("audit-writer", self._flush_loop)
            return
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="dsec-audit-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        self.flush()
        with self._db_lock:
            self._db.close()

    async def _flush_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.flush_interval)
            if self._pending:
                try:
                    await asyncio.to_thread(self.flush)
                except Exception as exc:  # never let the flusher die: keep the batch for later
                    # Once per streak, and a full disk without a traceback: it is not a bug.
                    if not failing:
                        if classify(exc) is not None:
                            log.warning("audit flush failed: %s; keeping the batch", exc)
                        else:
                            log.exception("audit flush failed")
                    failing = True
                else:
                    if failing:
                        log.warning("audit flush works again")
                    failing = False

    # -- writing -------------------------------------------------------------------------
    def tag(self, sandbox_id: str, job_id: str | None, trajectory_id: str | None) -> None:
        """Remember a sandbox's job and trajectory; every later row carries them."""
        with self._lock:
            self._tags[sandbox_id] = (job_id, trajectory_id)
        try:
            with self._db_lock:
                self._db.execute(
                    "INSERT OR REPLACE INTO tags VALUES (?, ?, ?)",
                    (sandbox_id, job_id, trajectory_id),
                )
        except sqlite3.Error as exc:
            # A full disk: the rows carry the tags anyway (kept in memory above).
            if classify(exc) is None:
                raise
            log.warning("audit tags of %s not stored: %s", sandbox_id, exc)

    def on_event(self, listener: Callable[[SecurityEvent], None]) -> None:
        """Call ``listener`` for every event as it is raised (metrics, streams)."""
        self._listeners.append(listener)

    def record(self, sandbox_id: str, kind: AuditKind, action: str, **detail: Any) -> None:
        self._append(sandbox_id, kind, action, None, None, detail)

    def event(
        self,
        sandbox_id: str,
        kind: EventKind,
        *,
        severity: Severity | None = None,
        **detail: Any,
    ) -> None:
        sev = severity or DEFAULT_SEVERITY.get(kind, Severity.WARNING)
        row = self._append(sandbox_id, AuditKind.EVENT, kind.value, kind, sev, detail)
        log.warning("sandbox %s: %s (%s) %s", sandbox_id, kind.value, sev.value, row.detail)
        if self._listeners:
            ev = _event(row)
            for listener in self._listeners:
                with contextlib.suppress(Exception):
                    listener(ev)

    def _append(
        self,
        sandbox_id: str,
        kind: AuditKind,
        action: str,
        event: EventKind | None,
        severity: Severity | None,
        detail: dict[str, Any],
    ) -> _Row:
        text = _clip(detail)
        with self._lock:
            self._seq += 1
            job, trajectory = self._tags.get(sandbox_id, (None, None))
            row = _Row(
                self._seq,
                time.time(),
                sandbox_id,
                job,
                trajectory,
                kind.value,
                action,
                event.value if event else None,
                severity.value if severity else None,
                text,
            )
            self._pending.append(row)
            waiters = list(self._waiters)
        for loop, ready in waiters:  # followers read it from the database (flushed then)
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(ready.set)
        return row

    async def wait_for_write(self, timeout: float) -> None:
        """Return once a record is written after this call, or after ``timeout``
        (followers of the log, dsec.security.auditstream). Records come from threads
        too: a writer wakes each waiter on the waiter's own loop."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter[1].wait(), timeout)
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        with self._db_lock:
            try:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            r.seq,
                            r.ts,
                            r.sandbox,
                            r.job,
                            r.trajectory,
                            r.kind,
                            r.action,
                            r.event,
                            r.severity,
                            r.detail,
                        )
                        for r in batch
                    ],
                )
                if batch[-1].seq % 10_000 < len(batch):
                    self._db.execute(
                        "DELETE FROM audit WHERE seq <= ?", (batch[-1].seq - self.max_rows,)
                    )
                self._db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                with self._lock:
                    self._pending[:0] = batch
                raise

    # -- reading -------------------------------------------------------------------------
    def _select(self, events_only: bool, kinds: list[str], f: Filters) -> list[_Row]:
        self.flush()
        where = ["seq > ?"]
        args: list[Any] = [f.get("since_seq", 0)]
        for column, key in (
            ("job", "job_id"),
            ("sandbox", "sandbox_id"),
            ("trajectory", "trajectory_id"),
        ):
            value = f.get(key)
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if events_only:
            where.append("event IS NOT NULL")
        wanted = sorted(set(kinds))
        if wanted:
            column = "event" if events_only else "kind"
            where.append(f"{column} IN ({','.join('?' * len(wanted))})")
            args.extend(wanted)
        sql = (
            "SELECT seq, ts, sandbox, job, trajectory, kind, action, event, severity, detail "
            f"FROM audit WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
        )
        args.append(f.get("limit", 1000))
        with self._db_lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_Row(*r) for r in rows]

    def records(
        self, *, kinds: Iterable[AuditKind] | None = None, **filters: Unpack[Filters]
    ) -> list[AuditRecord]:
        """Everything recorded, oldest first, matching every filter given."""
        return [_record(r) for r in self._select(False, [k.value for k in kinds or ()], filters)]

    def has_record(self, sandbox_id: str, kind: AuditKind, action: str, process: str) -> bool:
        """Whether ``action`` on ``process`` of a sandbox is on record (written, or
        waiting in the batch): what an edge that takes over a sandbox's processes
        checks, rather than trusting that the edge before it wrote what it saw end
        (it may have died between seeing the end and recording it)."""
        self.flush()
        with self._db_lock:
            row = self._db.execute(
                "SELECT 1 FROM audit WHERE sandbox = ? AND kind = ? AND action = ? "
                "AND json_extract(detail, '$.process') = ? LIMIT 1",
                (sandbox_id, kind.value, action, process),
            ).fetchone()
        return row is not None

    def events(
        self, *, kinds: Iterable[EventKind] | None = None, **filters: Unpack[Filters]
    ) -> list[SecurityEvent]:
        """Only the misbehaviour events, oldest first, matching every filter given."""
        return [_event(r) for r in self._select(True, [k.value for k in kinds or ()], filters)]


def _record(r: _Row) -> AuditRecord:
    return AuditRecord(
        seq=r.seq,
        time=datetime.fromtimestamp(r.ts, UTC),
        sandbox_id=r.sandbox,
        job_id=r.job,
        trajectory_id=r.trajectory,
        kind=AuditKind(r.kind),
        action=r.action,
        detail=json.loads(r.detail),
    )


def _event(r: _Row) -> SecurityEvent:
    return SecurityEvent(
        seq=r.seq,
        time=datetime.fromtimestamp(r.ts, UTC),
        sandbox_id=r.sandbox,
        job_id=r.job,
        trajectory_id=r.trajectory,
        kind=EventKind(r.event or "escape_attempt"),
        severity=Severity(r.severity or "warning"),
        detail=json.loads(r.detail),
    )


class NullAudit:
    """An audit sink that drops everything: for backends used outside a platform."""

    def record(self, sandbox_id: str, kind: AuditKind, action: str, **detail: Any) -> None:
        return None

    def event(
        self,
        sandbox_id: str,
        kind: EventKind,
        *,
        severity: Severity | None = None,
        **detail: Any,
    ) -> None:
        return None
