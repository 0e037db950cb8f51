"""envd on a cluster apiserver: every request relayed, streamed, to the sandbox's edge.

A cluster edge is a `dsec up` and serves envd itself (dsec.compat.e2b.envd) over its
own data plane, so the cluster apiserver does not serve envd a second time: it reads
``E2b-Sandbox-Id``, finds the sandbox's edge from the id (no lookup, as for our own
routes) and relays the request there through the cluster router (EdgeRelay). Bodies
go up as they come and answers come back as the edge sends them, chunk by chunk:
memory per request is one chunk, a process stream lasts as long as the edge keeps it
open (it sends keepalives), and a client that goes away closes the upstream request,
which ends the edge's stream too.

Who may: an ``X-Access-Token`` is the edge's own token (minted by that edge for that
sandbox at create or connect), so it is passed on and checked there, bound to the
sandbox it names; a forged one, or one of another sandbox, is refused there. Without
one, the ``X-API-KEY`` is checked here (our keys, IAM on the sandbox's project), and
the request goes on with a token the edge mints for it. The caller's API key never
reaches an edge. When the edge is not there the caller gets envd's typed error
(``unavailable``, ``not_found``) in the shape of the call, never a 500.
"""

from __future__ import annotations

import re
import struct
from collections.abc import AsyncIterator

import anyio
import httpx
from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from dsec.apiserver.limits import ApiLimits, set_body_limit
from dsec.apiserver.params import check_sandbox_id
from dsec.apiserver.relay import EdgeRelay
from dsec.compat.e2b import connect as c
from dsec.compat.e2b.access import Access
from dsec.compat.e2b.envd import envd_error, stream_error
from dsec.edge.tokens import looks_like_token
from dsec.errors import DSecError, SandboxNotFound

# What a relayed request keeps of the caller's headers: envd's own (the user is in
# Authorization: Basic), the body's framing, and nothing of ours.
PASSED_UP = (
    "authorization",
    "content-type",
    "connect-protocol-version",
    "connect-timeout-ms",
    "keepalive-ping-interval",
    "e2b-sandbox-id",
)
PASSED_DOWN = ("content-type", "content-disposition", "connect-content-encoding")
ENVD_SERVICES = ("process.Process", "filesystem.Filesystem")
# Only envd's own paths are relayed: a method name, nothing that could climb out.
RELAYED_PATH = re.compile(
    r"/(?:process\.Process|filesystem\.Filesystem)/[A-Za-z]{1,64}|/files|/health"
)


class EnvdRelay:
    def __init__(self, access: Access, relay: EdgeRelay, limits: ApiLimits) -> None:
        self.access = access
        self.relay = relay
        self.limits = limits

    async def headers(self, request: Request, sandbox_id: str) -> dict[str, str]:
        """The headers the edge gets: the caller's envd headers and a token for it."""
        h = request.headers
        up = {k: h[k] for k in PASSED_UP if k in h}
        token = h.get("x-access-token")
        if token and looks_like_token(token):
            up["x-access-token"] = token  # checked by the edge that minted it
        else:
            principal = await self.access.principal(h.get("x-api-key"))
            await self.access.sandbox(principal, sandbox_id)
            up["x-access-token"] = await self.access.token(sandbox_id)
        return up

    async def forward(self, request: Request) -> Response:
        try:
            if not RELAYED_PATH.fullmatch(request.url.path):
                raise c.ConnectError("not_found", f"no envd method {request.url.path[:100]!r}")
            raw_id = request.headers.get("e2b-sandbox-id")
            if not raw_id:
                raise SandboxNotFound("missing E2b-Sandbox-Id header")
            sandbox_id = check_sandbox_id(raw_id)
            headers = await self.headers(request, sandbox_id)
            if request.method == "POST":
                set_body_limit(request, self.limits.max_stream_bytes, "envd request")
            upstream = await self.relay.relay(
                sandbox_id,
                request.method,
                request.url.path,
                headers=headers,
                params=list(request.query_params.multi_items()),
                content=request.stream() if request.method == "POST" else None,
            )
        except (c.ConnectError, DSecError) as exc:
            return error_response(request, exc)
        except ClientDisconnect:  # gone mid-upload: the edge's request was cut with it
            return Response(status_code=499)
        down = {k: upstream.headers[k] for k in PASSED_DOWN if k in upstream.headers}
        return StreamingResponse(relayed(upstream), status_code=upstream.status_code, headers=down)


def error_response(request: Request, exc: c.ConnectError | DSecError) -> Response:
    """The error in the shape the caller's call expects: a Connect stream's end
    envelope, a Connect unary error, or envd's plain-HTTP error for /files."""
    if request.headers.get("content-type", "").startswith(c.STREAM_CONTENT_TYPE):
        return stream_error(exc)
    if request.url.path in ("/files", "/health"):
        return envd_error(exc)
    err = c.as_connect_error(exc)
    return Response(
        c.error_body(err),
        status_code=c.HTTP_STATUS.get(err.code, 500),
        media_type=c.UNARY_CONTENT_TYPE,
    )


class Framing:
    """Where a relayed Connect stream is between envelopes (sans I/O): so that an edge
    lost mid-stream can still be told to the caller as a proper end-of-stream error,
    whenever the bytes so far end on an envelope's boundary."""

    def __init__(self) -> None:
        self.header = b""  # the part of the next envelope's 5-byte header seen so far
        self.left = 0  # payload bytes of the current envelope still to come
        self.ended = False  # the edge's own end-of-stream envelope was seen

    def feed(self, data: bytes) -> None:
        while data:
            if self.left:
                step = min(self.left, len(data))
                self.left -= step
                data = data[step:]
                continue
            need = 5 - len(self.header)
            self.header += data[:need]
            data = data[need:]
            if len(self.header) == 5:
                flags, self.left = struct.unpack(">BI", self.header)
                self.ended = self.ended or bool(flags & c.FLAG_END_STREAM)
                self.header = b""

    @property
    def at_boundary(self) -> bool:
        return not self.left and not self.header


async def relayed(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The edge's answer as it comes; closed however the caller's side ends (a client
    that disconnects cancels this, and the close reaches the edge). An edge lost
    mid-stream ends a Connect stream with ``unavailable`` when it can be framed."""
    framing = Framing()
    connect = upstream.headers.get("content-type", "").startswith(c.STREAM_CONTENT_TYPE)
    try:
        async for chunk in upstream.aiter_raw():
            framing.feed(chunk)
            yield chunk
    except httpx.HTTPError as exc:
        if connect and framing.at_boundary and not framing.ended:
            lost = c.ConnectError("unavailable", f"lost the sandbox's edge mid-stream: {exc}")
            yield c.end_stream(lost)
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


def envd_relay_router(relay: EnvdRelay) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    for service in ENVD_SERVICES:  # the edge answers a method it does not know
        router.add_api_route(f"/{service}/{{method}}", relay.forward, methods=["POST"])
    router.add_api_route("/files", relay.forward, methods=["GET", "POST"])

    @router.get("/health")
    async def health(request: Request) -> Response:
        if request.headers.get("e2b-sandbox-id"):
            return await relay.forward(request)
        return Response(status_code=204)

    return router
