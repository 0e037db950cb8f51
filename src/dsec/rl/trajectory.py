"""Trajectory log and replay (DSEC.md §6.2): what an agent did, durable and replayable.

Every state-changing step a trainer sends with a trajectory id (job, rollout, step) is
written to a SQLite WAL log of its own (``trajectory.db`` in the edge's data dir)
*before* the answer leaves: first as ``pending`` (the request), then with its result.
When a preempted trainer resumes and sends the same steps again, each step whose number
and content hash match the log is answered from the log without touching the sandbox
(fast-forward); the first step that differs runs for real and the log after it is
discarded, since the new run never saw it. So a non-idempotent command never runs twice.

The decision is made here, in one place on the edge, for every entry point (the step
API, its batch form, and ``ExecRequest.trajectory`` on the plain exec route). A step's
execution is shielded from the caller going away: a trainer killed mid-step finds the
result in the log when it resumes. A step that was still ``pending`` when the platform
itself died is *in doubt* (it may or may not have run) and is a typed error, never
silently re-run. A step the log cannot answer whose sandbox is gone is
``TrajectoryStateLost`` (410).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.api.datapath import STDERR
from dsec.api.events import AuditKind
from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.sandbox import SandboxState
from dsec.api.trajectory import StepRecord, StepRequest, TrajectoryInfo, check_name
from dsec.errors import (
    Conflict,
    DSecError,
    InvalidArgument,
    NotFound,
    SandboxNotFound,
    TrajectoryStateLost,
    TrajectoryStepInDoubt,
    Unsupported,
)

if TYPE_CHECKING:
    from dsec.edge.dataplane import DataPlane
    from dsec.edge.edge import Edge

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    job_id TEXT NOT NULL, rollout_id TEXT NOT NULL, step INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL, op TEXT NOT NULL, hash TEXT NOT NULL,
    status TEXT NOT NULL, request TEXT NOT NULL, result TEXT,
    created_at REAL NOT NULL, finished_at REAL, replays INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, rollout_id, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS trajectories (
    job_id TEXT NOT NULL, rollout_id TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL,
    discarded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, rollout_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS bindings (
    sandbox_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, rollout_id TEXT NOT NULL
) WITHOUT ROWID;
"""


def step_digest(req: StepRequest) -> tuple[str, str]:
    """A step's ``(content hash, request JSON for the log)``: the hash covers everything
    that decides what the step does (sandbox, command, env, user, file bytes...), not
    the step number, so a resumed trainer that sends the same request again matches.
    File bytes enter the hash, but only their sha256 and size are stored."""
    body: dict[str, Any] = {"sandbox_id": req.sandbox_id, "op": req.op}
    if req.command is not None:
        body["command"] = req.command.model_dump(exclude_defaults=True)
    else:
        assert req.file is not None
        data = req.file.data()
        body["file"] = {
            "path": req.file.path,
            "mode": req.file.mode,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32], text


@dataclass(slots=True)
class Logged:
    """A step as the replay decision needs it."""

    step: int
    sandbox_id: str
    hash: str
    status: str
    result: str | None


@dataclass(slots=True)
class Outcome:
    """One answered step; ``body`` is the JSON of the result or of the error."""

    step: int
    replayed: bool
    ok: bool
    body: str

    def json(self) -> str:
        key = "result" if self.ok else "error"
        replayed = "true" if self.replayed else "false"
        return f'{{"step":{self.step},"replayed":{replayed},"{key}":{self.body}}}'


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


class TrajectoryLog:
    """The durable log: one SQLite file in WAL mode, one connection, serialised.

    ``synchronous=NORMAL`` (default): a commit survives a crash of the platform process
    (SIGKILL) at ~0.05 ms; ``DSEC_TRAJECTORY_SYNC=full`` also survives power loss
    (an fsync per commit)."""

    def __init__(self, path: Path | None) -> None:
        self._db = sqlite3.connect(
            ":memory:" if path is None else str(path),
            isolation_level=None,
            check_same_thread=False,
        )
        self._mu = threading.Lock()
        sync = "FULL" if os.environ.get("DSEC_TRAJECTORY_SYNC", "").lower() == "full" else "NORMAL"
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={sync}")
        self._db.executescript(_SCHEMA)
        self._bindings: dict[str, tuple[str, str]] = {
            sid: (job, rollout)
            for sid, job, rollout in self._db.execute(
                "SELECT sandbox_id, job_id, rollout_id FROM bindings"
            )
        }

    def close(self) -> None:
        with self._mu:
            self._db.close()

    # -- replay path ----------------------------------------------------------------------
    def window(self, job: str, rollout: str, first: int, last: int) -> dict[int, Logged]:
        with self._mu:
            rows = self._db.execute(
                "SELECT step, sandbox_id, hash, status, result FROM steps "
                "WHERE job_id=? AND rollout_id=? AND step BETWEEN ? AND ?",
                (job, rollout, first, last),
            ).fetchall()
        return {r[0]: Logged(*r) for r in rows}

    def next_step(self, job: str, rollout: str) -> int:
        with self._mu:
            row = self._db.execute(
                "SELECT max(step) FROM steps WHERE job_id=? AND rollout_id=?", (job, rollout)
            ).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def count_replays(self, job: str, rollout: str, first: int, last: int) -> None:
        with self._mu:
            self._db.execute(
                "UPDATE steps SET replays=replays+1 "
                "WHERE job_id=? AND rollout_id=? AND step BETWEEN ? AND ?",
                (job, rollout, first, last),
            )

    def used_sandbox(self, job: str, rollout: str, sandbox_id: str) -> bool:
        with self._mu:
            row = self._db.execute(
                "SELECT 1 FROM steps WHERE job_id=? AND rollout_id=? AND sandbox_id=? LIMIT 1",
                (job, rollout, sandbox_id),
            ).fetchone()
        return row is not None

    def binding(self, sandbox_id: str) -> tuple[str, str] | None:
        return self._bindings.get(sandbox_id)

    # -- writes ---------------------------------------------------------------------------
    def begin(
        self, job: str, rollout: str, step: int, sandbox_id: str, op: str, hash_: str, req: str
    ) -> None:
        """The request, durable before the sandbox is touched (status ``pending``)."""
        now = time.time()
        with self._mu:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT INTO steps (job_id, rollout_id, step, sandbox_id, op, hash, "
                    "status, request, created_at) VALUES (?,?,?,?,?,?,'pending',?,?)",
                    (job, rollout, step, sandbox_id, op, hash_, req, now),
                )
                self._db.execute(
                    "INSERT INTO trajectories (job_id, rollout_id, created_at, updated_at) "
                    "VALUES (?,?,?,?) ON CONFLICT DO UPDATE SET updated_at=excluded.updated_at",
                    (job, rollout, now, now),
                )
                if sandbox_id not in self._bindings:
                    self._db.execute(
                        "INSERT OR IGNORE INTO bindings VALUES (?,?,?)", (sandbox_id, job, rollout)
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._bindings.setdefault(sandbox_id, (job, rollout))

    def append(
        self, job: str, rollout: str, sandbox_id: str, op: str, request: str, ok: bool, body: str
    ) -> int:
        """A step the platform itself observed (a hosted rollout's ``model_call``): the
        next step number, request and result in one transaction; returns the number.
        Its hash covers the request, so no caller's step ever matches it by accident."""
        now = time.time()
        hash_ = hashlib.sha256(f"{op}\n{request}".encode()).hexdigest()[:32]
        with self._mu:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT max(step) FROM steps WHERE job_id=? AND rollout_id=?", (job, rollout)
                ).fetchone()
                step = 0 if row[0] is None else int(row[0]) + 1
                self._db.execute(
                    "INSERT INTO steps (job_id, rollout_id, step, sandbox_id, op, hash, status, "
                    "request, result, created_at, finished_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        job,
                        rollout,
                        step,
                        sandbox_id,
                        op,
                        hash_,
                        "ok" if ok else "error",
                        request,
                        body,
                        now,
                        now,
                    ),
                )
                self._db.execute(
                    "INSERT INTO trajectories (job_id, rollout_id, created_at, updated_at) "
                    "VALUES (?,?,?,?) ON CONFLICT DO UPDATE SET updated_at=excluded.updated_at",
                    (job, rollout, now, now),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return step

    def finish(self, job: str, rollout: str, step: int, ok: bool, body: str) -> None:
        with self._mu:
            self._db.execute(
                "UPDATE steps SET status=?, result=?, finished_at=? "
                "WHERE job_id=? AND rollout_id=? AND step=?",
                ("ok" if ok else "error", body, time.time(), job, rollout, step),
            )

    def truncate(self, job: str, rollout: str, from_step: int) -> int:
        """Drop ``from_step`` and everything after it; returns how many steps went."""
        with self._mu:
            self._db.execute("BEGIN")
            try:
                n = self._db.execute(
                    "DELETE FROM steps WHERE job_id=? AND rollout_id=? AND step>=?",
                    (job, rollout, from_step),
                ).rowcount
                self._db.execute(
                    "UPDATE trajectories SET discarded=discarded+?, updated_at=? "
                    "WHERE job_id=? AND rollout_id=?",
                    (n, time.time(), job, rollout),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return int(n)

    # -- queries --------------------------------------------------------------------------
    def infos(self, job: str, rollout: str | None = None) -> list[TrajectoryInfo]:
        sql = (
            "SELECT t.job_id, t.rollout_id, t.created_at, t.updated_at, t.discarded, "
            "count(s.step), group_concat(DISTINCT s.sandbox_id) FROM trajectories t "
            "LEFT JOIN steps s ON s.job_id=t.job_id AND s.rollout_id=t.rollout_id "
            "WHERE t.job_id=?" + (" AND t.rollout_id=?" if rollout is not None else "")
        )
        args: tuple[str, ...] = (job,) if rollout is None else (job, rollout)
        with self._mu:
            rows = self._db.execute(
                sql + " GROUP BY t.job_id, t.rollout_id ORDER BY t.rollout_id", args
            ).fetchall()
        return [
            TrajectoryInfo(
                job_id=r[0],
                rollout_id=r[1],
                created_at=_ts(r[2]),
                updated_at=_ts(r[3]),
                discarded=r[4],
                steps=r[5],
                sandboxes=sorted(r[6].split(",")) if r[6] else [],
            )
            for r in rows
        ]

    def records(
        self, job: str, rollout: str | None, *, after: int = -1, limit: int = 1000
    ) -> list[StepRecord]:
        """Steps in order (rollout, step); ``after``: only steps > after (paging)."""
        sql = (
            "SELECT job_id, rollout_id, step, sandbox_id, op, hash, status, request, result, "
            "created_at, finished_at, replays FROM steps WHERE job_id=?"
        )
        args: list[Any] = [job]
        if rollout is not None:
            sql += " AND rollout_id=? AND step>?"
            args += [rollout, after]
        sql += " ORDER BY rollout_id, step LIMIT ?"
        args.append(limit)
        with self._mu:
            rows = self._db.execute(sql, args).fetchall()
        out = []
        for r in rows:
            body = json.loads(r[8]) if r[8] else None
            out.append(
                StepRecord(
                    job_id=r[0],
                    rollout_id=r[1],
                    step=r[2],
                    sandbox_id=r[3],
                    op=r[4],
                    hash=r[5],
                    status=r[6],
                    request=json.loads(r[7]),
                    result=body if r[6] == "ok" else None,
                    error=body if r[6] == "error" else None,
                    created_at=_ts(r[9]),
                    finished_at=_ts(r[10]),
                    replays=r[11],
                )
            )
        return out

    def export(self, job: str, rollout: str | None = None) -> Iterator[str]:
        """JSONL lines of every step, in order; paged so memory stays bounded."""
        rollouts = [rollout] if rollout is not None else [i.rollout_id for i in self.infos(job)]
        for rid in rollouts:
            after = -1
            while True:
                page = self.records(job, rid, after=after, limit=1000)
                if not page:
                    break
                for rec in page:
                    yield rec.model_dump_json() + "\n"
                after = page[-1].step


class TrajectoryService:
    """The replay decision, for every entry point; owns the log."""

    def __init__(self, edge: Edge, log_: TrajectoryLog, dataplane: DataPlane | None = None):
        self.edge = edge
        self.log = log_
        self.dataplane = dataplane
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, job: str, rollout: str, steps: list[StepRequest]) -> list[Outcome]:
        """Answer consecutive steps in order; stops after the first one that failed.

        The work runs in a task of its own that the caller going away does not cancel:
        a step that started is always finished and logged."""
        check_name(job, "job id")
        check_name(rollout, "rollout id")
        task = asyncio.ensure_future(self._run_locked(job, rollout, steps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def exec(self, sandbox_id: str, req: ExecRequest, ref: TrajectoryRef) -> ExecResult:
        """``ExecRequest.trajectory`` on the plain exec route: the same log, one step."""
        fields = req.model_dump(exclude_defaults=True, exclude={"trajectory"})
        step = StepRequest.model_validate(
            {"step": ref.step, "sandbox_id": sandbox_id, "command": fields}
        )
        (out,) = await self.run(ref.job_id, ref.rollout_id, [step])
        if not out.ok:
            raise _error(out.body)
        return ExecResult.model_validate_json(out.body)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int, ref: TrajectoryRef
    ) -> None:
        """A trajectory ref on the plain file-write route: the same log, one step."""
        step = StepRequest.model_validate(
            {
                "step": ref.step,
                "sandbox_id": sandbox_id,
                "file": {
                    "path": path,
                    "content_b64": base64.b64encode(data).decode(),
                    "mode": mode,
                },
            }
        )
        (out,) = await self.run(ref.job_id, ref.rollout_id, [step])
        if not out.ok:
            raise _error(out.body)

    async def _run_locked(self, job: str, rollout: str, steps: list[StepRequest]) -> list[Outcome]:
        lock = self._locks.setdefault((job, rollout), asyncio.Lock())
        async with lock:
            first, last = steps[0].step, steps[-1].step
            nxt = self.log.next_step(job, rollout)
            if first > nxt:
                raise InvalidArgument(
                    f"step {first} of {job}/{rollout} skips ahead: the log ends before step "
                    f"{nxt}, so send step {nxt} next",
                    next_step=nxt,
                )
            logged = self.log.window(job, rollout, first, last) if first < nxt else {}
            out: list[Outcome] = []
            replayed_to = -1
            for req in steps:
                hash_, text = step_digest(req)
                row = logged.get(req.step)
                if row is not None and row.hash == hash_:
                    if row.status == "pending":
                        raise TrajectoryStepInDoubt(
                            f"step {req.step} of {job}/{rollout} was running when the platform "
                            "stopped: it may or may not have changed the sandbox, so it is "
                            "neither replayed nor run again; discard it (DELETE "
                            f"/v1/trajectories/{job}/{rollout}?from_step={req.step}) to go on",
                            step=req.step,
                        )
                    out.append(Outcome(req.step, True, row.status == "ok", row.result or "{}"))
                    replayed_to = req.step
                    if row.status != "ok":
                        break
                    continue
                # Checked before discarding anything: a step that cannot run keeps the log.
                self._check_sandbox(job, rollout, req.sandbox_id)
                if row is not None or req.step < nxt:
                    dropped = self.log.truncate(job, rollout, req.step)
                    logged = {}
                    self.edge.audit.record(
                        req.sandbox_id,
                        AuditKind.COMMAND,
                        "trajectory_diverged",
                        job_id=job,
                        rollout_id=rollout,
                        step=req.step,
                        discarded=dropped,
                    )
                outcome = await self._execute(job, rollout, req, hash_, text)
                out.append(outcome)
                nxt = req.step + 1
                if not outcome.ok:
                    break
            if replayed_to >= 0:
                self.log.count_replays(job, rollout, first, replayed_to)
            return out

    def _check_sandbox(self, job: str, rollout: str, sandbox_id: str) -> None:
        """A step that must run needs its sandbox alive and bound to this rollout."""
        rec = self.edge.find(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            if self.log.used_sandbox(job, rollout, sandbox_id):
                state = "gone" if rec is None else rec.state.value
                raise TrajectoryStateLost(
                    f"trajectory {job}/{rollout} cannot go on: the log answers only the steps "
                    f"it holds, and sandbox {sandbox_id}, whose state the next step needs, is "
                    f"{state}" + (f" ({rec.reason})" if rec is not None and rec.reason else ""),
                    sandbox_id=sandbox_id,
                    state=state,
                )
            if rec is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
            self.edge.running_record(sandbox_id)  # raises SandboxNotRunning
        spec = rec.spec
        if (spec.job_id is not None and spec.job_id != job) or (
            spec.trajectory_id is not None and spec.trajectory_id != rollout
        ):
            raise Conflict(
                f"sandbox {sandbox_id} belongs to {spec.job_id}/{spec.trajectory_id}, "
                f"not to trajectory {job}/{rollout}",
                sandbox_id=sandbox_id,
            )
        bound = self.log.binding(sandbox_id)
        if bound is not None and bound != (job, rollout):
            raise Conflict(
                f"sandbox {sandbox_id} is bound to trajectory {bound[0]}/{bound[1]}; "
                f"trajectories never share a sandbox (asked by {job}/{rollout})",
                sandbox_id=sandbox_id,
            )

    async def _execute(
        self, job: str, rollout: str, req: StepRequest, hash_: str, text: str
    ) -> Outcome:
        self.log.begin(job, rollout, req.step, req.sandbox_id, req.op, hash_, text)
        ok, body = True, "{}"
        try:
            body = await self._do(req)
        except DSecError as exc:
            ok, body = False, json.dumps(exc.to_payload()["error"], default=str)
        except Exception as exc:  # logged as what the caller saw, then re-raised
            log.exception("trajectory step %s/%s#%d failed", job, rollout, req.step)
            ok = False
            body = json.dumps({"code": "internal", "message": str(exc)[:500], "details": {}})
        self.log.finish(job, rollout, req.step, ok, body)
        return Outcome(req.step, False, ok, body)

    async def _do(self, req: StepRequest) -> str:
        sid = req.sandbox_id
        if req.file is not None:
            data = req.file.data()
            await self.edge.write_file(sid, req.file.path, data, mode=req.file.mode)
            return json.dumps({"path": req.file.path, "size": len(data)})
        assert req.command is not None
        cmd = req.command
        if cmd.session is None:
            fields = cmd.model_dump(exclude_defaults=True, exclude={"session", "keep_stdin"})
            res = await self.edge.exec(sid, ExecRequest.model_validate(fields))
            return res.model_dump_json()
        if self.dataplane is None:
            raise Unsupported("session steps need the edge's data path")
        start = time.perf_counter()
        proc = await self.dataplane.start(sid, cmd, background=False)
        out: list[bytes] = []
        err: list[bytes] = []
        async for stream, data in proc.output(trim=True):
            (err if stream == STDERR else out).append(data)
        info = await proc.wait()
        return ExecResult(
            exit_code=info.exit_code,
            stdout=b"".join(out).decode(errors="replace"),
            stderr=b"".join(err).decode(errors="replace"),
            duration=info.duration or time.perf_counter() - start,
            timed_out=info.timed_out,
            truncated=info.truncated,
        ).model_dump_json()

    def discard(self, job: str, rollout: str, from_step: int) -> int:
        """Drop ``from_step`` on (e.g. an in-doubt step, after checking the sandbox)."""
        check_name(job, "job id")
        check_name(rollout, "rollout id")
        if not self.log.infos(job, rollout):
            raise NotFound(f"no trajectory {job}/{rollout}")
        return self.log.truncate(job, rollout, from_step)


def _error(body: str) -> DSecError:
    from dsec.errors import error_class_for

    payload = json.loads(body)
    exc = error_class_for(str(payload.get("code", "")))(str(payload.get("message", "")))
    exc.details = dict(payload.get("details") or {})
    return exc
