"""/v1/events and /v1/audit: what sandboxes did and where they misbehaved.

A trainer polls ``/v1/events?job_id=...&since_seq=N`` after (or during) a rollout and
discards or penalises it; ``/v1/audit`` is the full record for an investigation.

With IAM the records are a tenant's: a caller without a role on every project must
filter by a sandbox it may use (dsec.apiserver.sandboxaccess; another's is 404) or a
job of a project it holds ``runtime`` on (dsec.control.jobs; another's is 403).
"""

# No `from __future__ import annotations`: FastAPI must see the local dependencies.
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Query, Request
from starlette.datastructures import QueryParams
from starlette.responses import Response, StreamingResponse

from dsec.api.events import AuditKind, AuditRecord, EventKind, SecurityEvent
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.params import INT64_MAX
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.control.jobs import JobAccess
from dsec.errors import InvalidArgument, PermissionDenied
from dsec.security.audit import AuditLog, Filters
from dsec.security.auditstream import AuditFollower

MAX_LIMIT = 10_000
# Module level: FastAPI resolves the (postponed) annotations in module globals.
Job = Annotated[str | None, Query(max_length=128, description="RL job id")]
Sandbox = Annotated[str | None, Query(max_length=64, description="sandbox id")]
Trajectory = Annotated[str | None, Query(max_length=128, description="trajectory id")]
# Cursors are SQLite INTEGERs: past 2^63 - 1 they were an OverflowError (a 500).
Since = Annotated[
    int, Query(ge=0, le=INT64_MAX, description="only rows with seq > since_seq (cursor)")
]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]


def _json_list(items: list[AuditRecord] | list[SecurityEvent]) -> Response:
    body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
    return Response(body, media_type="application/json")


def query_filters(
    job_id: Job = None,
    sandbox_id: Sandbox = None,
    trajectory_id: Trajectory = None,
    since_seq: Since = 0,
    limit: Limit = 1000,
) -> Filters:
    return Filters(
        job_id=job_id,
        sandbox_id=sandbox_id,
        trajectory_id=trajectory_id,
        since_seq=since_seq,
        limit=limit,
    )


QueryFilters = Annotated[Filters, Depends(query_filters)]

WHOLE_LOG = (
    "reading the audit log of every sandbox needs a role on every project; "
    "filter by sandbox_id (a sandbox you may use) or job_id (a job of your project)"
)


class AuditQuery(Protocol):
    """Rows kept elsewhere (cluster mode: every edge's own log, dsec.cluster.fanout)."""

    async def answer(self, params: QueryParams, filters: Filters, events: bool) -> Response: ...

    async def follow(self, request: Request, filters: Filters) -> Response:
        """The live stream (``/v1/events/stream``) over wherever the rows are kept."""
        ...


def _no_cluster_cursor(request: Request) -> None:
    """One node pages with since_seq; a cluster cursor here would silently restart."""
    if "cursor" in request.query_params:
        raise InvalidArgument(
            "this server is one node: page with since_seq (the SDK's '@N' cursors); "
            "'edge:seq' cursors come from a cluster's apiserver"
        )


def security_router(
    audit: AuditLog | AuditQuery,
    auth: Authenticator,
    access: SandboxAccess,
    jobs: JobAccess,
) -> APIRouter:
    async def scoped(principal: Annotated[str, Depends(auth)], filters: QueryFilters) -> Filters:
        """The query's filters, once the caller may read what they select."""
        if await access.sees_all(principal):
            return filters
        sandbox_id = filters.get("sandbox_id")
        job_id = filters.get("job_id")
        if sandbox_id is None and job_id is None:
            raise PermissionDenied(WHOLE_LOG)
        if sandbox_id is not None:
            await access.require(principal, sandbox_id, action="reading a sandbox's audit log")
        if job_id is not None:
            await jobs.require(principal, job_id, "reading a job's audit log")
        return filters

    Scoped = Annotated[Filters, Depends(scoped)]
    router = APIRouter(
        tags=["security"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.get("/v1/events", response_model=list[SecurityEvent], summary="Misbehaviour events")
    async def events(
        request: Request,
        filters: Scoped,
        kind: Annotated[list[EventKind], Query(description="repeatable")] = [],  # noqa: B006
    ) -> Response:
        """Events in order; page with ``since_seq`` = the last ``seq`` seen."""
        if not isinstance(audit, AuditLog):
            return await audit.answer(request.query_params, filters, events=True)
        _no_cluster_cursor(request)
        return _json_list(audit.events(kinds=kind, **filters))

    @router.get("/v1/audit", response_model=list[AuditRecord], summary="Audit log")
    async def audit_records(
        request: Request,
        filters: Scoped,
        kind: Annotated[list[AuditKind], Query(description="repeatable")] = [],  # noqa: B006
    ) -> Response:
        """Every command, file operation, network decision and event, in order."""
        if not isinstance(audit, AuditLog):
            return await audit.answer(request.query_params, filters, events=False)
        _no_cluster_cursor(request)
        return _json_list(audit.records(kinds=kind, **filters))

    @router.get(
        "/v1/events/stream",
        summary="Live audit stream (server-sent events)",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def stream(
        request: Request,
        filters: Scoped,
        kind: Annotated[list[AuditKind], Query(description="repeatable")] = [],  # noqa: B006
    ) -> Response:
        """Every audit record as it is written (lifecycle changes, commands, file and
        network decisions, misbehaviour events), oldest first, as ``text/event-stream``:
        ``id`` is the record's ``seq``, ``event`` its kind, ``data`` the record as JSON.
        Resume with ``Last-Event-ID`` (what EventSource sends) or ``since_seq``; on a
        cluster's apiserver ``id`` is a cursor over every edge (``e1:120,e2:45``)."""
        if not isinstance(audit, AuditLog):
            return await audit.follow(request, filters)
        _no_cluster_cursor(request)
        cursor = filters.get("since_seq", 0)
        last = request.headers.get("last-event-id", "").strip()
        if last:
            if not last.isdigit() or len(last) > 18:
                raise InvalidArgument("Last-Event-ID must be the seq of a record this stream sent")
            cursor = max(cursor, int(last))
        follow = AuditFollower(audit, filters, list(kind), cursor)
        return StreamingResponse(
            follow.frames(request.is_disconnected),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router
