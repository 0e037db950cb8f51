"""E2B's control-plane REST API (api.e2b.dev) over our SandboxCreator and edge.

Paths and JSON shapes are the ones the `e2b` SDK's generated client sends and parses;
errors are E2B's ``{"code": <http status>, "message"}``. Every create goes through
``SandboxCreator`` (IAM, quota charge, placement, Idempotency-Key), every stop too.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from dsec.api.exec import ExecRequest
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.params import check_sandbox_id
from dsec.compat.e2b.access import Access
from dsec.compat.e2b.mapping import E2BConfig, create_spec, created, detail, listed
from dsec.edge.idempotency import check_key
from dsec.errors import BackendError, Conflict, DSecError, InvalidArgument

CREATE_TIMEOUT = 300.0
MAX_PAGE = 1000

Handler = Callable[..., Awaitable[Response]]


def e2b_error(exc: DSecError) -> JSONResponse:
    """E2B's error body; our 422 (invalid input) is E2B's 400."""
    status = 400 if exc.status == 422 else exc.status
    return JSONResponse({"code": status, "message": exc.message}, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        raise InvalidArgument("the body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object")
    return body


def control_router(access: Access, creator: SandboxCreator, config: E2BConfig) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    edge = access.edge

    async def guarded(request: Request, work: Callable[[str], Awaitable[Response]]) -> Response:
        try:
            principal = await access.principal(api_key_of(request))
            return await work(principal)
        except DSecError as exc:
            return e2b_error(exc)

    @router.post("/v2/sandboxes")
    @router.post("/sandboxes")
    async def create(request: Request) -> Response:
        async def work(principal: str) -> Response:
            key = request.headers.get("idempotency-key")
            spec = create_spec(await _json(request), config, job_for(principal, key))
            if key is None:
                info = await creator.create(principal, spec, timeout=CREATE_TIMEOUT)
            else:
                info, _made = await creator.create_keyed(
                    principal, spec, timeout=CREATE_TIMEOUT, key=check_key(key)
                )
            await prepare_user(access, info)
            return JSONResponse(created(info, await access.token(info.id)), status_code=201)

        return await guarded(request, work)

    @router.get("/sandboxes/{sandbox_id}")
    async def get(request: Request, sandbox_id: str) -> Response:
        async def work(principal: str) -> Response:
            info = await access.sandbox(principal, check_sandbox_id(sandbox_id))
            return JSONResponse(detail(info, await access.token(info.id)))

        return await guarded(request, work)

    @router.delete("/sandboxes/{sandbox_id}")
    async def kill(request: Request, sandbox_id: str) -> Response:
        async def work(principal: str) -> Response:
            info = await access.sandbox(principal, check_sandbox_id(sandbox_id))
            await creator.stop(principal, info.id)
            return Response(status_code=204)

        return await guarded(request, work)

    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    @router.post("/sandboxes/{sandbox_id}/connect")
    async def connect(request: Request, sandbox_id: str) -> Response:
        async def work(principal: str) -> Response:
            info = await access.sandbox(principal, check_sandbox_id(sandbox_id))
            if info.state is SandboxState.PAUSED:
                await access.resume(principal, info)
                info = await edge.get(info.id)
                return JSONResponse(created(info, await access.token(info.id)), status_code=201)
            return JSONResponse(created(info, await access.token(info.id)))

        return await guarded(request, work)

    @router.post("/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(request: Request, sandbox_id: str) -> Response:
        async def work(principal: str) -> Response:
            info = await access.sandbox(principal, check_sandbox_id(sandbox_id))
            timeout = (await _json(request)).get("timeout")
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
                raise InvalidArgument("timeout must be a non-negative integer of seconds")
            ttl = info.spec.ttl_running_stop or 0
            if timeout > ttl:
                raise InvalidArgument(
                    f"timeout {timeout}s is longer than this sandbox's idle TTL ({ttl}s, "
                    "set by the create's timeout): create it with a longer timeout"
                )
            await access.touch(info.id, timeout)  # its idle clock starts over
            return Response(status_code=204)

        return await guarded(request, work)

    @router.post("/sandboxes/{sandbox_id}/pause")
    async def pause(request: Request, sandbox_id: str) -> Response:
        async def work(principal: str) -> Response:
            info = await access.sandbox(principal, check_sandbox_id(sandbox_id))
            if info.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox {info.id} is already paused")
            await access.pause(principal, info)
            return Response(status_code=204)

        return await guarded(request, work)

    @router.get("/v2/sandboxes")
    async def list_sandboxes(request: Request) -> Response:
        async def work(principal: str) -> Response:
            q = request.query_params
            labels = dict(parse_qsl(q.get("metadata", ""), keep_blank_values=True))
            states = {s.strip() for s in q.get("state", "running,paused").split(",") if s}
            wanted = set()
            if "running" in states:
                wanted |= {SandboxState.RUNNING, SandboxState.CREATING}
            if "paused" in states:
                wanted.add(SandboxState.PAUSED)
            limit = _int(q.get("limit"), 100, "limit")
            if not 1 <= limit <= MAX_PAGE:
                raise InvalidArgument(f"limit must be 1..{MAX_PAGE}")
            after = q.get("nextToken")
            items = await edge.list(labels=labels or None, states=wanted) if wanted else []
            template = q.get("template")
            mine = [
                i
                for i in sorted(items, key=_order)
                if (template is None or listed(i)["templateID"] == template)
                and await access.may_use(principal, i)
            ]
            if after:
                mine = [i for i in mine if _cursor(i) > after]
            page = mine[:limit]
            resp = JSONResponse([listed(i) for i in page])
            if len(mine) > limit:
                resp.headers["x-next-token"] = _cursor(page[-1])
            return resp

        return await guarded(request, work)

    return router


def job_for(principal: str, key: str | None) -> str:
    """The sandbox's own job id; the same for a replayed Idempotency-Key (same spec)."""
    if key is None:
        return "e2b-" + secrets.token_hex(10)
    return "e2b-" + hashlib.sha256(f"{principal}\n{key}".encode()).hexdigest()[:20]


def _order(info: SandboxInfo) -> str:
    return _cursor(info)


def _cursor(info: SandboxInfo) -> str:
    return f"{info.created_at.timestamp():020.6f}.{info.id}"


def _int(value: str | None, default: int, what: str) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"{what} must be an integer") from None


SETUP_USER = (
    "grep -q '^user:' /etc/passwd 2>/dev/null || echo 'user:x:1000:1000:user:/home/user:/bin/sh'"
    " >> /etc/passwd; grep -q '^user:' /etc/group 2>/dev/null || echo 'user:x:1000:'"
    " >> /etc/group; mkdir -p /home/user && chown 1000:1000 /home/user"
)


async def prepare_user(access: Access, info: SandboxInfo) -> None:
    """E2B's default user ``user`` (uid 1000) and its home, made when the image lacks
    them: one exec on the sandbox's edge (in process, or through the cluster router)."""
    result = await access.edge.exec(info.id, ExecRequest(command=SETUP_USER, user="root"))
    if result.exit_code != 0:
        raise BackendError(f"could not prepare the default user (exit {result.exit_code})")


def api_key_of(request: Request) -> str | None:
    """E2B's ``X-API-KEY``; else our own ``Authorization: Bearer`` key, which is how a
    cluster apiserver asks an edge's E2B routes (with the cluster token)."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    scheme, _, cred = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return cred.strip() or None
