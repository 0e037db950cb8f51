"""The durable state of hosted rollouts: one SQLite file on the edge (``rollouts.db``).

Everything a worker needs to go on after an edge restart is here, written before it is
acted on: the spec (with the model key: this file is the edge's, root-only, like its
token key), the state, the agent sandbox, the id under which the sandbox's agent keeps
the scaffold process, the gateway token, the verdict. The job's current model endpoint
and the gateway's port (the scaffold has it in its environment, so it must not change
across restarts) live here too.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsec.api.fncall import JudgeResult
from dsec.api.rollouts import (
    TERMINAL,
    ModelEndpoint,
    RolloutInfo,
    RolloutSpec,
    RolloutState,
)
from dsec.api.verify import VerifyResult
from dsec.errors import AlreadyExists

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, job_id TEXT NOT NULL, rollout_id TEXT NOT NULL,
    principal TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
    token TEXT NOT NULL UNIQUE, sandbox_id TEXT, process_id TEXT,
    exit_code INTEGER, reward REAL, verdict TEXT, judgement TEXT, error TEXT,
    model_calls INTEGER NOT NULL DEFAULT 0, model_retries INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, finished_at REAL,
    deadline REAL NOT NULL, acked INTEGER NOT NULL DEFAULT 0,
    UNIQUE (job_id, rollout_id)
);
CREATE INDEX IF NOT EXISTS rollouts_job ON rollouts (job_id, state);
CREATE TABLE IF NOT EXISTS endpoints (job_id TEXT PRIMARY KEY, endpoint TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_COLS = (
    "id, job_id, rollout_id, principal, spec, state, token, sandbox_id, process_id, "
    "exit_code, reward, verdict, judgement, error, model_calls, model_retries, created_at, "
    "updated_at, finished_at, deadline, acked"
)


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


@dataclass(slots=True)
class Rollout:
    """One row, typed."""

    id: str
    job_id: str
    rollout_id: str
    principal: str
    spec: RolloutSpec
    state: RolloutState
    token: str
    sandbox_id: str | None
    process_id: str | None
    exit_code: int | None
    reward: float | None
    verdict: str | None
    judgement: str | None
    error: str | None
    model_calls: int
    model_retries: int
    created_at: float
    updated_at: float
    finished_at: float | None
    deadline: float
    acked: bool

    def info(self) -> RolloutInfo:
        return RolloutInfo(
            id=self.id,
            job_id=self.job_id,
            rollout_id=self.rollout_id,
            state=self.state,
            sandbox_id=self.sandbox_id,
            project=self.spec.sandbox.project,
            created_at=datetime.fromtimestamp(self.created_at, UTC),
            updated_at=datetime.fromtimestamp(self.updated_at, UTC),
            finished_at=_ts(self.finished_at),
            deadline=datetime.fromtimestamp(self.deadline, UTC),
            exit_code=self.exit_code,
            reward=self.reward,
            verdict=None
            if self.verdict is None
            else VerifyResult.model_validate_json(self.verdict),
            judgement=None
            if self.judgement is None
            else JudgeResult.model_validate_json(self.judgement),
            model_calls=self.model_calls,
            model_retries=self.model_retries,
            error=self.error,
            acked=self.acked,
        )


def _row(r: tuple[Any, ...]) -> Rollout:
    return Rollout(
        id=r[0],
        job_id=r[1],
        rollout_id=r[2],
        principal=r[3],
        spec=RolloutSpec.model_validate_json(r[4]),
        state=RolloutState(r[5]),
        token=r[6],
        sandbox_id=r[7],
        process_id=r[8],
        exit_code=r[9],
        reward=r[10],
        verdict=r[11],
        judgement=r[12],
        error=r[13],
        model_calls=r[14],
        model_retries=r[15],
        created_at=r[16],
        updated_at=r[17],
        finished_at=r[18],
        deadline=r[19],
        acked=bool(r[20]),
    )


class RolloutStore:
    """One connection, serialised (writes are tiny; WAL, synchronous=NORMAL: a commit
    survives a SIGKILL of the edge)."""

    def __init__(self, path: Path | None) -> None:
        self._db = sqlite3.connect(
            ":memory:" if path is None else str(path), isolation_level=None, check_same_thread=False
        )
        self._mu = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._mu:
            self._db.close()

    # -- rollouts -------------------------------------------------------------------------
    def insert(self, ro: Rollout) -> None:
        with self._mu:
            try:
                self._db.execute(
                    f"INSERT INTO rollouts ({_COLS}) VALUES ({','.join('?' * 21)})",
                    (
                        ro.id,
                        ro.job_id,
                        ro.rollout_id,
                        ro.principal,
                        ro.spec.model_dump_json(),
                        ro.state.value,
                        ro.token,
                        ro.sandbox_id,
                        ro.process_id,
                        ro.exit_code,
                        ro.reward,
                        ro.verdict,
                        ro.judgement,
                        ro.error,
                        ro.model_calls,
                        ro.model_retries,
                        ro.created_at,
                        ro.updated_at,
                        ro.finished_at,
                        ro.deadline,
                        int(ro.acked),
                    ),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExists(
                    f"rollout {ro.rollout_id!r} of job {ro.job_id!r} exists already",
                    job_id=ro.job_id,
                    rollout_id=ro.rollout_id,
                ) from None

    def update(self, ro: Rollout, **fields: Any) -> None:
        """Set ``fields`` on the row and on ``ro`` (the worker's copy) together."""
        now = time.time()
        fields["updated_at"] = now
        if fields.get("state") in TERMINAL and ro.finished_at is None:
            fields["finished_at"] = now
        sets = ", ".join(f"{k}=?" for k in fields)
        values = [v.value if isinstance(v, RolloutState) else v for v in fields.values()]
        with self._mu:
            self._db.execute(f"UPDATE rollouts SET {sets} WHERE id=?", (*values, ro.id))
        for key, value in fields.items():
            setattr(ro, key, value)

    def bump(self, ro: Rollout, *, calls: int = 0, retries: int = 0) -> None:
        with self._mu:
            self._db.execute(
                "UPDATE rollouts SET model_calls=model_calls+?, model_retries=model_retries+?, "
                "updated_at=? WHERE id=?",
                (calls, retries, time.time(), ro.id),
            )
        ro.model_calls += calls
        ro.model_retries += retries

    def get(self, rollout_id: str) -> Rollout | None:
        with self._mu:
            row = self._db.execute(
                f"SELECT {_COLS} FROM rollouts WHERE id=?", (rollout_id,)
            ).fetchone()
        return None if row is None else _row(row)

    def by_token(self, token: str) -> Rollout | None:
        with self._mu:
            row = self._db.execute(
                f"SELECT {_COLS} FROM rollouts WHERE token=?", (token,)
            ).fetchone()
        return None if row is None else _row(row)

    def live(self) -> list[Rollout]:
        terminal = tuple(s.value for s in TERMINAL)
        with self._mu:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM rollouts WHERE state NOT IN (?,?,?)", terminal
            ).fetchall()
        return [_row(r) for r in rows]

    def of_job(
        self,
        job_id: str,
        states: list[RolloutState] | None = None,
        *,
        unacked_only: bool = False,
        limit: int = 10_000,
    ) -> list[Rollout]:
        sql = f"SELECT {_COLS} FROM rollouts WHERE job_id=?"
        args: list[Any] = [job_id]
        if states:
            sql += f" AND state IN ({','.join('?' * len(states))})"
            args += [s.value for s in states]
        if unacked_only:
            sql += " AND acked=0"
        sql += " ORDER BY finished_at, created_at, id LIMIT ?"
        args.append(limit)
        with self._mu:
            rows = self._db.execute(sql, args).fetchall()
        return [_row(r) for r in rows]

    def ack(self, job_id: str, ids: list[str]) -> tuple[list[str], list[str], list[str]]:
        """Acknowledge finished rollouts of ``job_id``: (newly acked, already, unknown),
        in one transaction, so an ack is counted once whatever is retried."""
        terminal = {s.value for s in TERMINAL}
        acked: list[str] = []
        already: list[str] = []
        unknown: list[str] = []
        with self._mu:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for rid in dict.fromkeys(ids):
                    row = self._db.execute(
                        "SELECT state, acked FROM rollouts WHERE id=? AND job_id=?", (rid, job_id)
                    ).fetchone()
                    if row is None or row[0] not in terminal:
                        unknown.append(rid)
                    elif row[1]:
                        already.append(rid)
                    else:
                        self._db.execute("UPDATE rollouts SET acked=1 WHERE id=?", (rid,))
                        acked.append(rid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return acked, already, unknown

    # -- endpoints and settings -----------------------------------------------------------
    def endpoint(self, job_id: str) -> ModelEndpoint | None:
        with self._mu:
            row = self._db.execute(
                "SELECT endpoint FROM endpoints WHERE job_id=?", (job_id,)
            ).fetchone()
        return None if row is None else ModelEndpoint.model_validate_json(row[0])

    def set_endpoint(self, job_id: str, endpoint: ModelEndpoint, *, only_if_unset: bool) -> None:
        verb = "INSERT OR IGNORE" if only_if_unset else "INSERT OR REPLACE"
        with self._mu:
            self._db.execute(
                f"{verb} INTO endpoints (job_id, endpoint) VALUES (?,?)",
                (job_id, json.dumps(endpoint.model_dump())),
            )

    def setting(self, key: str) -> str | None:
        with self._mu:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_setting(self, key: str, value: str) -> None:
        with self._mu:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?,?)", (key, value))
