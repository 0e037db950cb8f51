"""Events, audit and trajectories through an apiserver: the edges' own logs, asked.

Each edge keeps its sandboxes' audit log and trajectory log on its own disk; the
apiserver keeps neither. A query about one sandbox (or one rollout step batch) goes to
the edge its id names; anything else is asked of every up edge at once, each within
``DSEC_FANOUT_TIMEOUT_S`` (5 s), and the answers are merged.

What a merged answer cannot say in its body (a JSON list, as on one node) travels in
headers, so single-node clients read it unchanged:

- ``X-DSec-Edges-Missing: e2,e3``: edges that are down or did not answer in time; their
  rows are not in this answer (``complete=true`` turns that into a 503 instead).
- ``X-DSec-Cursor: e1:120,e2:45``: where each edge's rows of this answer end. An
  audit ``seq`` is its edge's own, so one integer cannot page over many edges: pass the
  header back as ``cursor=`` for the next page. An edge missing from this answer keeps
  its old position, so its rows come with a later page, never lost. ``since_seq`` stays
  exact when the query names a sandbox (one edge); on a query over many edges it is
  refused (422) rather than read against every edge's numbering and skip rows.

The live stream (``/v1/events/stream``) is the same merged query asked again and
again (``ClusterAudit.follow``): every frame's SSE ``id`` is the cursor just after
its record, so a browser's EventSource resumes exactly with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from dsec.api.cluster import EDGE_ID_PATTERN
from dsec.api.events import AuditRecord
from dsec.api.trajectory import StepBatch, check_name
from dsec.cluster.registry import DOWN
from dsec.cluster.remote import RemoteEdge
from dsec.cluster.router import ClusterEdge, edge_of
from dsec.errors import DSecError, EdgeUnavailable, InvalidArgument, NotFound, SandboxNotFound
from dsec.security.audit import Filters
from dsec.security.auditstream import KEEPALIVE, PAGE, frame

log = logging.getLogger(__name__)
T = TypeVar("T")

MISSING_HEADER = "X-DSec-Edges-Missing"
CURSOR_HEADER = "X-DSec-Cursor"
_JSON = "application/json"
# Query parameters the apiserver reads itself and does not forward to the edges.
_OWN_PARAMS = {"cursor", "complete", "since_seq"}
_STEP_WAIT_CAP_S = 6 * 3600.0
MAX_CURSOR_EDGES = 10_000
_EDGE_ID = re.compile(EDGE_ID_PATTERN)
# An edge id is at most 16 characters and a seq at most 18 digits: "edge:seq,".
MAX_CURSOR_CHARS = MAX_CURSOR_EDGES * 36
# How often a live stream asks the edges for rows after its cursor when none came.
STREAM_POLL_S = 1.0


def fanout_timeout() -> float:
    return float(os.environ.get("DSEC_FANOUT_TIMEOUT_S", "5"))


class Edges:
    """The apiserver's edges as its ClusterEdge sees them (read-only), for fan-outs."""

    def __init__(self, router: ClusterEdge, *, timeout: float | None = None) -> None:
        self.router = router
        self.timeout = fanout_timeout() if timeout is None else timeout

    def split(self) -> tuple[list[RemoteEdge], dict[str, str]]:
        """(clients of the edges to ask, edge -> why it is not asked)."""
        up: list[RemoteEdge] = []
        down: dict[str, str] = {}
        for status, remote in self.router.members():
            if status.status == DOWN or remote is None:
                down[status.edge_id] = f"down: {status.down_reason or 'marked down'}"
            else:
                up.append(remote)
        return up, down

    async def of_sandbox(self, sandbox_id: str) -> RemoteEdge | None:
        """The client of the edge holding ``sandbox_id``; None when no such edge exists.
        A down edge holds the rows asked for: a 503 naming it, not an empty answer."""
        try:
            status, remote = await self.router.status_of(sandbox_id)
        except SandboxNotFound:
            return None
        if status.status == DOWN or remote is None:
            raise EdgeUnavailable(
                f"edge {status.edge_id}, which holds sandbox {sandbox_id} and its logs, is "
                f"down ({status.down_reason or 'marked down'}); retry when it is back",
                edge=status.edge_id,
            )
        return remote

    async def ask(
        self, remote: RemoteEdge, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        """One request within the fan-out time; a silent edge is EdgeUnavailable."""
        try:
            return await asyncio.wait_for(
                remote.forward(method, path, timeout=self.timeout, **kwargs), self.timeout + 1
            )
        except TimeoutError:
            raise EdgeUnavailable(
                f"edge {remote.edge_id} did not answer {path} within {self.timeout:g}s",
                edge=remote.edge_id,
            ) from None

    async def gather(
        self, op: Callable[[RemoteEdge], Awaitable[T]], *, only: str | None = None
    ) -> tuple[dict[str, T], dict[str, str]]:
        """``op`` on every up edge at once (or on edge ``only`` alone): (answers by
        edge, edge -> why missing). A typed error an edge answers (e.g. NotFound) is
        the caller's to read, so it is in neither map: it is re-raised unless ``op``
        handles it."""
        remotes, missing = self.split()
        if only is not None:
            remotes = [r for r in remotes if r.edge_id == only]
            missing = {e: why for e, why in missing.items() if e == only}
        results = await asyncio.gather(*(op(r) for r in remotes), return_exceptions=True)
        out: dict[str, T] = {}
        for remote, result in zip(remotes, results, strict=True):
            if isinstance(result, DSecError) and _unreachable(result):
                log.warning("edge %s missing from a fan-out: %s", remote.edge_id, result)
                missing[remote.edge_id] = str(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                out[remote.edge_id] = result
        return out, missing


def _unreachable(exc: DSecError) -> bool:
    return isinstance(exc, EdgeUnavailable) or exc.code in ("timeout", "unavailable")


def missing_headers(missing: Iterable[str]) -> dict[str, str]:
    names = ",".join(sorted(missing))
    return {MISSING_HEADER: names} if names else {}


def _require_complete(params: QueryParams, missing: dict[str, str]) -> None:
    if missing and params.get("complete", "").lower() in ("1", "true", "yes"):
        raise EdgeUnavailable(
            f"{len(missing)} edge(s) did not answer: "
            + "; ".join(f"{e}: {why}" for e, why in sorted(missing.items())),
            edges=sorted(missing),
        )


# -- events and audit ---------------------------------------------------------------------
def parse_cursor(text: str | None) -> dict[str, int]:
    """``e1:120,e2:45`` -> {"e1": 120, "e2": 45}. Client input (a query parameter or
    ``Last-Event-ID``): every part is checked and the whole is bounded."""
    if not text:
        return {}
    bad = InvalidArgument(
        f"bad cursor {text[:200]!r}: expected edge:seq[,edge:seq...] as sent in "
        f"the {CURSOR_HEADER} header or as a stream's event id"
    )
    if len(text) > MAX_CURSOR_CHARS:
        raise bad
    out: dict[str, int] = {}
    parts = text.split(",")
    if len(parts) > MAX_CURSOR_EDGES:
        raise bad
    for part in parts:
        edge, _, seq = part.partition(":")
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
        if not _EDGE_ID.fullmatch(edge) or not (seq.isascii() and seq.isdigit()) or len(seq) > 18:
            raise bad
        out[edge] = int(seq)
    return out


def format_cursor(positions: dict[str, int]) -> str:
    return ",".join(f"{e}:{s}" for e, s in sorted(positions.items()))


def _when(item: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(item["time"]))


def _keyed(edge_id: str, rows: list[dict[str, Any]]) -> list[tuple[datetime, str, dict[str, Any]]]:
    return [(_when(r), edge_id, r) for r in rows]


def _merge(
    answers: dict[str, list[dict[str, Any]]], limit: int
) -> list[tuple[str, dict[str, Any]]]:
    """Up to ``limit`` rows of every edge's answer merged by time, as (edge, row).

    A merge keeps every edge's own order (by seq) whatever the clocks say, so the rows
    taken from an edge are always a prefix of its answer: a cursor at the last one
    taken is exact (nothing skipped, nothing repeated)."""
    merged = heapq.merge(
        *(_keyed(e, rows) for e, rows in sorted(answers.items())),
        key=lambda t: (t[0], t[1]),
    )
    out: list[tuple[str, dict[str, Any]]] = []
    for _, edge_id, row in merged:
        if len(out) >= limit:
            break
        out.append((edge_id, row))
    return out


class ClusterAudit:
    """``/v1/events``, ``/v1/audit`` and ``/v1/events/stream`` over every edge
    (dsec.apiserver.security)."""

    def __init__(self, router: ClusterEdge, *, timeout: float | None = None) -> None:
        self.edges = Edges(router, timeout=timeout)
        self.router = router

    async def rows(
        self,
        path: str,
        forwarded: list[tuple[str, str]],
        cursor: dict[str, int],
        *,
        only: str | None = None,
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
        """Every up edge's (or edge ``only``'s) rows after its position in ``cursor``."""

        async def one(remote: RemoteEdge) -> list[dict[str, Any]]:
            params = [*forwarded, ("since_seq", str(cursor.get(remote.edge_id, 0)))]
            resp = await self.edges.ask(remote, "GET", path, params=params)
            rows: list[dict[str, Any]] = json.loads(resp.content)
            return rows

        return await self.edges.gather(one, only=only)

    async def answer(self, request_params: QueryParams, filters: Filters, events: bool) -> Response:
        path = "/v1/events" if events else "/v1/audit"
        forwarded = [(k, v) for k, v in request_params.multi_items() if k not in _OWN_PARAMS]
        sandbox = filters.get("sandbox_id")
        if sandbox is not None:
            # One edge holds every row of the sandbox: its answer as it is, and
            # since_seq means exactly what it means on one node.
            remote = await self.edges.of_sandbox(sandbox)
            if remote is None:
                return Response("[]", media_type=_JSON)
            params = [*forwarded, ("since_seq", str(filters.get("since_seq", 0)))]
            resp = await self.edges.ask(remote, "GET", path, params=params)
            return Response(resp.content, media_type=_JSON)
        cursor = parse_cursor(request_params.get("cursor"))
        if filters.get("since_seq", 0) and not request_params.get("cursor"):
            raise InvalidArgument(
                "since_seq numbers rows per edge, and this query spans every edge of the "
                "cluster: filter by sandbox_id (one edge, exact since_seq), or page with "
                f"cursor= set to the {CURSOR_HEADER} header of the previous answer"
            )
        answers, missing = await self.rows(path, forwarded, cursor)
        _require_complete(request_params, missing)
        page: list[dict[str, Any]] = []
        positions = dict(cursor)
        for edge_id, row in _merge(answers, filters.get("limit", 1000)):
            page.append(row)
            positions[edge_id] = int(row["seq"])
        for edge_id in answers:
            positions.setdefault(edge_id, 0)
        headers = {CURSOR_HEADER: format_cursor(positions), **missing_headers(missing)}
        return Response(json.dumps(page, separators=(",", ":")), media_type=_JSON, headers=headers)

    async def follow(self, request: Request, filters: Filters) -> Response:
        """``/v1/events/stream`` of a cluster: every edge's audit records as they are
        written, fanned in, as server-sent events whose ``id`` is a cursor.

        Why polling the merged query, not a fan-in of the edges' own streams: the
        cursor logic is the one ``answer`` pages with (exact, tested: an edge that is
        down or silent keeps its position and its rows come once it is back), edges
        that join or leave are picked up by the next poll with no per-edge connection
        to reopen, and a viewer costs no long-lived connection to every edge. The price
        is up to ``STREAM_POLL_S`` more delay and, while a stream is quiet, one small
        query per up edge per second per open stream: right for a dashboard and a
        few followers, not for hundreds of them (they should follow each edge).

        The cursor: ``cursor=``, ``since_seq`` (with ``sandbox_id`` only: one edge, as
        on one node) and ``Last-Event-ID`` (what EventSource sends on reconnect; per
        edge, the furthest of them wins). It is client input: ``parse_cursor`` bounds
        and checks it, and positions of edges this cluster does not know are dropped,
        so the id echoed in every frame is at most one entry per edge of the cluster
        (an edge that joined after the cursor was made starts from its first row)."""
        params = request.query_params
        cursor = parse_cursor(params.get("cursor"))
        for edge_id, seq in parse_cursor(request.headers.get("last-event-id", "").strip()).items():
            cursor[edge_id] = max(seq, cursor.get(edge_id, 0))
        sandbox = filters.get("sandbox_id")
        since = filters.get("since_seq", 0)
        only = edge_of(sandbox) if sandbox is not None else None
        if only is not None:
            cursor[only] = max(since, cursor.get(only, 0))
        elif since:
            raise InvalidArgument(
                "since_seq numbers rows per edge, and this stream spans every edge of the "
                "cluster: filter by sandbox_id (one edge, exact since_seq), or resume with "
                "cursor= (or Last-Event-ID) set to the id of the last event received"
            )
        known = self.router.known_edges()
        cursor = {e: s for e, s in cursor.items() if e in known}
        skip = _OWN_PARAMS | {"limit"}
        forwarded = [(k, v) for k, v in params.multi_items() if k not in skip]
        forwarded.append(("limit", str(PAGE)))
        follower = _MergedFollower(self, forwarded, cursor, only)
        return StreamingResponse(
            follower.frames(request.is_disconnected),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class _MergedFollower:
    """One client's position on every edge (``ClusterAudit.follow``)."""

    def __init__(
        self,
        audit: ClusterAudit,
        forwarded: list[tuple[str, str]],
        cursor: dict[str, int],
        only: str | None,
    ) -> None:
        self.audit = audit
        self.forwarded = forwarded
        self.cursor = cursor
        self.only = only

    async def frames(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        quiet_since = time.monotonic()
        yield ": dsec audit stream (cluster)\n\n"
        while True:
            answers, missing = await self.audit.rows(
                "/v1/audit", self.forwarded, self.cursor, only=self.only
            )
            if missing:
                log.info("audit stream: edges not answering: %s", ", ".join(sorted(missing)))
            rows = _merge(answers, PAGE)
            for edge_id, row in rows:
                record = AuditRecord.model_validate(row)  # the frame's kind is an enum
                self.cursor[edge_id] = record.seq
                yield frame(record, format_cursor(self.cursor))
            if len(rows) >= PAGE:
                quiet_since = time.monotonic()
                continue  # more is waiting: no sleep
            if rows:
                quiet_since = time.monotonic()
            if await disconnected():
                return
            if time.monotonic() - quiet_since >= KEEPALIVE:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            await asyncio.sleep(STREAM_POLL_S)


# -- trajectories -------------------------------------------------------------------------
def _traj_path(job: str, rollout: str | None = None) -> str:
    out = "/v1/trajectories/" + quote(check_name(job, "job id"), safe="")
    if rollout is not None:
        out += "/" + quote(check_name(rollout, "rollout id"), safe="")
    return out


def _step_wait(batch: StepBatch) -> float:
    """How long a batch may take on the edge: its commands' own timeouts, in sequence."""
    total = 60.0
    for step in batch.steps:
        cmd = step.command
        total += (cmd.timeout or 3600.0) + 10 if cmd is not None else 60.0
    return min(total, _STEP_WAIT_CAP_S)


class ClusterTrajectories:
    """``/v1/trajectories`` over the edges (dsec.apiserver.trajectory).

    A rollout's log is kept where its steps run: on the edge of its sandbox. Steps go
    there; queries by job ask every edge (a job's rollouts spread over the cluster)."""

    def __init__(self, router: ClusterEdge, *, timeout: float | None = None) -> None:
        self.edges = Edges(router, timeout=timeout)
        self.router = router

    async def steps(self, job: str, rollout: str, body: bytes, batch: StepBatch) -> Response:
        edges = {edge_of(s.sandbox_id) for s in batch.steps}
        if len(edges) > 1:
            raise InvalidArgument(
                f"steps of one batch of {job}/{rollout} name sandboxes on edges "
                f"{', '.join(sorted(edges))}: a rollout's log lives on its sandbox's edge, "
                "so send the steps of each edge's sandbox in batches of their own"
            )
        sid = batch.steps[0].sandbox_id
        remote = await self.router.remote_of(sid)
        path = _traj_path(job, rollout) + "/steps"
        resp = await remote.forward(
            "POST",
            path,
            content=body,
            headers={"Content-Type": _JSON},
            timeout=_step_wait(batch),
        )
        return Response(resp.content, media_type=_JSON)

    async def job(self, job: str, format: str, rollout: str | None) -> Response:
        params = {"format": format, **({"rollout_id": rollout} if rollout else {})}
        path = _traj_path(job)

        async def one(remote: RemoteEdge) -> bytes:
            resp = await self.edges.ask(remote, "GET", path, params=params)
            return resp.content

        answers, missing = await self.edges.gather(one)
        headers = missing_headers(missing)
        if format == "jsonl":
            lines = [
                json.loads(line)
                for text in answers.values()
                for line in text.splitlines()
                if line.strip()
            ]
            lines.sort(key=lambda r: (str(r.get("rollout_id")), int(r.get("step", 0))))
            body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines)
            return Response(body, media_type="application/x-ndjson", headers=headers)
        infos = [i for text in answers.values() for i in json.loads(text)]
        infos.sort(key=lambda i: str(i["rollout_id"]))
        return Response(json.dumps(infos, separators=(",", ":")), media_type=_JSON, headers=headers)

    async def _found(
        self, method: str, path: str, **kwargs: Any
    ) -> tuple[dict[str, httpx.Response], dict[str, str]]:
        """Every edge's answer but NotFound; NotFound from all that answered, while some
        did not, is a 503: the one that holds it may be among them."""

        async def one(remote: RemoteEdge) -> httpx.Response | None:
            try:
                return await self.edges.ask(remote, method, path, **kwargs)
            except NotFound:
                return None

        answers, missing = await self.edges.gather(one)
        found = {e: r for e, r in answers.items() if r is not None}
        if not found and missing:
            raise EdgeUnavailable(
                f"{path} is on none of the edges that answered; "
                f"{', '.join(sorted(missing))} did not answer",
                edges=sorted(missing),
            )
        return found, missing

    async def rollout(self, job: str, rollout: str) -> Response:
        found, missing = await self._found("GET", _traj_path(job, rollout))
        if not found:
            raise NotFound(f"no trajectory {job}/{rollout}")
        # The same name on two edges (its sandbox moved): the one written last.
        infos = [json.loads(r.content) for r in found.values()]
        best = max(infos, key=lambda i: str(i.get("updated_at")))
        return Response(json.dumps(best), media_type=_JSON, headers=missing_headers(missing))

    async def records(self, job: str, rollout: str, after: int, limit: int) -> Response:
        params = {"after": str(after), "limit": str(limit)}
        found, missing = await self._found(
            "GET", _traj_path(job, rollout) + "/steps", params=params
        )
        rows = [row for r in found.values() for row in json.loads(r.content)]
        rows.sort(key=lambda r: int(r["step"]))
        body = json.dumps(rows[:limit], separators=(",", ":"))
        return Response(body, media_type=_JSON, headers=missing_headers(missing))

    async def discard(self, job: str, rollout: str, from_step: int) -> dict[str, int]:
        path = _traj_path(job, rollout)
        found, missing = await self._found("DELETE", path, params={"from_step": str(from_step)})
        if not found:
            raise NotFound(f"no trajectory {job}/{rollout}")
        if missing:
            # Dropping steps on some edges only would leave the rest to replay later.
            raise EdgeUnavailable(
                f"edges {', '.join(sorted(missing))} did not answer: the discard of "
                f"{job}/{rollout} reached {', '.join(sorted(found))} only; repeat it",
                edges=sorted(missing),
            )
        return {"discarded": sum(int(r.json()["discarded"]) for r in found.values())}
