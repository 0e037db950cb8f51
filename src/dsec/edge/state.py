"""The edge's durable record of its sandboxes, written before anything is acknowledged.

Plain ``sqlite3`` (WAL, synchronous=NORMAL) rather than SQLAlchemy: this sits on the
create/stop hot path, a write costs ~0.1 ms, and the store is private to one edge.
WAL with NORMAL survives a crash of the process (SIGKILL) without losing a committed
row; after a power loss the sandboxes are gone too, and recovery sweeps the host.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import run_args_adapter
from dsec.backends.base import BackendFacts, SandboxRecord, StoredFacts

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    image TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    reason TEXT,
    runtime TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
-- When each sandbox's idle TTL fires absent new activity (unix time; dsec.edge.ttl).
CREATE TABLE IF NOT EXISTS idle_deadlines (
    id TEXT PRIMARY KEY,
    deadline REAL NOT NULL
);
-- Idempotency-Key of a create -> the sandbox it made (dsec.edge.idempotency).
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys(expires_at);
CREATE INDEX IF NOT EXISTS idempotency_keys_sandbox ON idempotency_keys(sandbox_id);
"""


@dataclass(frozen=True)
class KeyRow:
    """One stored Idempotency-Key: who sent it (scope), the spec's fingerprint, the
    sandbox the create made and when the key expires (unix time)."""

    scope: str
    key: str
    fingerprint: str
    sandbox_id: str
    expires_at: float


@dataclass(frozen=True)
class RuntimeColumn:
    """The ``runtime`` column: the backend's facts, the edge's network, the data
    plane's sessions.

    Written as ``{"facts": {...}, "net": ..., "sessions": {...}}``. Releases before
    typed facts wrote one flat object, the backend's keys beside ``net``, ``sessions``
    and (while creating) ``protected_layers``: a row without ``facts`` is read that way,
    so an edge upgraded in place re-adopts the sandboxes the old one left."""

    facts: BackendFacts
    net: dict[str, Any] | None
    sessions: dict[str, dict[str, str]]

    @classmethod
    def encode(cls, rec: SandboxRecord) -> str:
        body: dict[str, Any] = {"facts": rec.facts.to_json()}
        if rec.net is not None:
            body["net"] = rec.net
        if rec.sessions:
            body["sessions"] = rec.sessions
        return json.dumps(body)

    @classmethod
    def decode(cls, text: str) -> RuntimeColumn:
        body = json.loads(text)
        if not isinstance(body, dict):
            body = {}
        if "facts" in body:
            facts = body.get("facts")
        else:  # a release before typed facts: one flat object
            body = dict(body)
            facts = {k: v for k, v in body.items() if k not in _EDGE_KEYS}
        net, sessions = body.get("net"), body.get("sessions")
        return cls(
            facts=StoredFacts(dict(facts) if isinstance(facts, dict) else {}),
            net=net if isinstance(net, dict) else None,
            sessions=sessions if isinstance(sessions, dict) else {},
        )


# What the edge, not the backend, kept in the flat runtime object of older releases.
_EDGE_KEYS = frozenset({"net", "sessions", "protected_layers"})

_INSERT = (
    "INSERT OR REPLACE INTO sandboxes "
    "(id, state, spec, image, created_at, updated_at, reason, runtime) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


class EdgeStateDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def save(self, rec: SandboxRecord, *, key: KeyRow | None = None) -> None:
        """Write the whole record; with ``key``, its Idempotency-Key in the same
        transaction (a create is never acknowledged with its key unwritten)."""
        row = (
            rec.id,
            rec.state.value,
            rec.spec.model_dump_json(),
            rec.image.model_dump_json(),
            rec.created_at.isoformat(),
            rec.updated_at.isoformat(),
            rec.reason,
            RuntimeColumn.encode(rec),
        )
        with self._lock:
            if key is None:
                self._db.execute(_INSERT, row)
                return
            self._db.execute("BEGIN")
            try:
                self._db.execute(_INSERT, row)
                self._db.execute(
                    "INSERT OR REPLACE INTO idempotency_keys VALUES (?, ?, ?, ?, ?)",
                    (key.scope, key.key, key.fingerprint, key.sandbox_id, key.expires_at),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def save_state(self, rec: SandboxRecord) -> None:
        """Write a state change: state, reason, times and runtime column, not the spec or
        image, which do not change after create (save() when they do). Re-encoding
        both with pydantic on every change was most of a write's cost. A record that
        was never saved is written whole."""
        row = (
            rec.state.value,
            rec.updated_at.isoformat(),
            rec.reason,
            RuntimeColumn.encode(rec),
            rec.id,
        )
        with self._lock:
            cur = self._db.execute(
                "UPDATE sandboxes SET state = ?, updated_at = ?, reason = ?, runtime = ? "
                "WHERE id = ?",
                row,
            )
        if cur.rowcount != 1:
            self.save(rec)

    def load(self, edge: str) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, state, spec, image, created_at, updated_at, reason, runtime "
                "FROM sandboxes"
            ).fetchall()
        out = []
        for r in rows:
            column = RuntimeColumn.decode(r[7])
            out.append(
                SandboxRecord(
                    id=r[0],
                    state=SandboxState(r[1]),
                    spec=run_args_adapter.validate_json(r[2]),
                    image=ImageInfo.model_validate_json(r[3]),
                    created_at=datetime.fromisoformat(r[4]),
                    updated_at=datetime.fromisoformat(r[5]),
                    reason=r[6],
                    facts=column.facts,  # stored: the edge has its backend read them
                    net=column.net,
                    sessions=column.sessions,
                    edge=edge,
                )
            )
        return out

    def forget_terminal(self, older_than: datetime) -> int:
        """Drop history of stopped/failed sandboxes; the live ones are never touched."""
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM sandboxes WHERE state IN ('stopped', 'failed') AND updated_at < ?",
                (older_than.isoformat(),),
            )
            self._db.execute(
                "DELETE FROM idle_deadlines WHERE id NOT IN (SELECT id FROM sandboxes)"
            )
        return cur.rowcount

    # -- idle deadlines (dsec.edge.ttl) ---------------------------------------------------
    def save_idle_deadlines(self, deadlines: Iterable[tuple[str, float]]) -> None:
        """Write (sandbox id, unix time) pairs in one transaction."""
        rows = list(deadlines)
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR REPLACE INTO idle_deadlines VALUES (?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def load_idle_deadlines(self) -> dict[str, float]:
        with self._lock:
            rows = self._db.execute("SELECT id, deadline FROM idle_deadlines").fetchall()
        return {str(r[0]): float(r[1]) for r in rows}

    # -- idempotency keys (dsec.edge.idempotency) -----------------------------------------
    def find_key(self, scope: str, key: str, now: float) -> KeyRow | None:
        """The unexpired row of ``key`` in ``scope`` (primary-key lookup)."""
        with self._lock:
            r = self._db.execute(
                "SELECT scope, key, fingerprint, sandbox_id, expires_at FROM idempotency_keys "
                "WHERE scope = ? AND key = ? AND expires_at > ?",
                (scope, key, now),
            ).fetchone()
        return None if r is None else KeyRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), r[4])

    def delete_keys_of(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM idempotency_keys WHERE sandbox_id = ?", (sandbox_id,))

    def delete_key(self, scope: str, key: str) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM idempotency_keys WHERE scope = ? AND key = ?", (scope, key)
            )

    def delete_expired_keys(self, now: float) -> int:
        with self._lock:
            cur = self._db.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?", (now,))
        return cur.rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()
