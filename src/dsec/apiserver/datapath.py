"""HTTP and WebSocket routes of the data path (sessions, streaming, PTY, files, archives).

The edge serves these under ``/v1/edge/...`` with a per-sandbox token (``Authorization:
Bearer dst1...`` or ``?token=``) that it checks without a database round trip; an API key
works too, which is how the apiserver proxies for callers that cannot reach an edge. The
file and archive routes are also mounted under ``/v1/sandboxes/{id}`` with API-key auth,
next to the older exec and file routes. In cluster mode each edge serves ``/v1/edge`` on
its own address: ``SandboxInfo.data_path.url`` says which.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Security, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import Response, StreamingResponse

from dsec.api.datapath import EDGE_PREFIX, RPC_PATH, PtyControl
from dsec.api.desktop import ComputerAction
from dsec.api.exec import CommandArgs
from dsec.api.files import (
    ChmodRequest,
    FileInfo,
    FileList,
    MkdirRequest,
    MoveRequest,
    RemoveRequest,
)
from dsec.api.images import ImageInfo, SnapshotRequest
from dsec.api.sandbox import DataPathInfo
from dsec.apiserver.auth import MISSING_KEY, Authenticator, KeyVerifier
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.filestreams import nonempty
from dsec.apiserver.limits import ApiLimits, set_body_limit
from dsec.apiserver.params import MAX_LIST_LIMIT, check_sandbox_id, check_sandbox_path, parse_mode
from dsec.apiserver.responses import model_response
from dsec.apiserver.rpc import RpcConnection
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.wsmux import close_with_error, refuse_handshake
from dsec.edge.dataplane import DataPlane
from dsec.edge.liveview import LiveViews
from dsec.edge.tokens import Scope, looks_like_token
from dsec.errors import DSecError, Unauthenticated

_OCTET = "application/octet-stream"
_TAR = "application/x-tar"
VIEW_TOKEN_PATH = "/v1/sandboxes/{sandbox_id}/view-token"
_bearer = HTTPBearer(auto_error=False, description="sandbox token (dst1/dsv1...) or API key")


class DataAuth:
    """A sandbox token bound to the path's sandbox, or an API key whose principal may
    use that sandbox (dsec.apiserver.sandboxaccess: 404 for another tenant's)."""

    def __init__(self, keys: KeyVerifier, plane: DataPlane, access: SandboxAccess) -> None:
        self.keys = keys
        self.plane = plane
        self.access = access

    async def check(
        self, sandbox_id: str | None, credential: str | None, *, scope: Scope = "full"
    ) -> None:
        """``scope="view"``: the live view's route, which a view-only token also opens."""
        if not credential:
            raise Unauthenticated(MISSING_KEY + " or a sandbox token")
        if looks_like_token(credential):
            if sandbox_id is None:
                raise Unauthenticated("a sandbox token is only valid on that sandbox's routes")
            self.plane.authorize(sandbox_id, credential, scope=scope)
        else:
            principal = await self.keys.verify(credential)
            if sandbox_id is None:
                raise Unauthenticated("this route needs a sandbox id")
            await self.access.require(principal, sandbox_id)

    async def handshake(self, credential: str | None) -> str | None:
        """Check the credential of a multiplexed socket: the principal of an API key
        (each frame's sandbox is then checked against it), None for a sandbox token.

        A token must carry our signature, but may have expired: every frame is checked
        again against its own sandbox's token, and an SDK holding an expired token must
        still reach the frame that tells it to renew."""
        if not credential:
            raise Unauthenticated(MISSING_KEY + " or a sandbox token")
        if not looks_like_token(credential):
            return await self.keys.verify(credential)
        parts = credential.split(".")
        sandbox_id = parts[1] if len(parts) == 4 else ""
        try:
            self.plane.authorize(sandbox_id, credential)
        except Unauthenticated as exc:
            if "expired_at" not in exc.details:
                raise
        return None

    async def __call__(
        self,
        sandbox_id: str,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> None:
        credential = credentials.credentials if credentials is not None else None
        await self.check(check_sandbox_id(sandbox_id), credential)


def _header_credential(ws: WebSocket) -> str | None:
    value = ws.headers.get("authorization", "")
    scheme, _, cred = value.partition(" ")
    return cred.strip() if scheme.lower() == "bearer" and cred.strip() else None


def file_router(plane: DataPlane, limits: ApiLimits, auth: Callable[..., object]) -> APIRouter:
    """Metadata, archive and streamed file routes of one sandbox (mounted twice)."""
    router = APIRouter(
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
        tags=["files"],
    )

    @router.get("/fs/stat", response_model=FileInfo, summary="Stat a path (lstat)")
    async def stat_path(sandbox_id: str, path: str, follow: bool = False) -> Response:
        return model_response(await plane.stat(sandbox_id, check_sandbox_path(path), follow=follow))

    @router.get("/fs/list", response_model=FileList, summary="List a directory")
    async def list_dir(
        sandbox_id: str,
        path: str,
        recursive: bool = False,
        limit: Annotated[int | None, Query(ge=1, le=MAX_LIST_LIMIT)] = None,
    ) -> Response:
        """Entries never follow symlinks; `recursive` walks subdirectories (paths relative)."""
        return model_response(
            await plane.list_dir(
                sandbox_id, check_sandbox_path(path), recursive=recursive, limit=limit
            )
        )

    @router.post("/fs/mkdir", status_code=204, response_class=Response, summary="mkdir (-p)")
    async def mkdir(sandbox_id: str, body: MkdirRequest) -> Response:
        await plane.mkdir(
            sandbox_id, check_sandbox_path(body.path), parents=body.parents, mode=body.mode
        )
        return Response(status_code=204)

    @router.post("/fs/remove", status_code=204, response_class=Response, summary="rm (-r)")
    async def remove(sandbox_id: str, body: RemoveRequest) -> Response:
        await plane.remove(sandbox_id, check_sandbox_path(body.path), recursive=body.recursive)
        return Response(status_code=204)

    @router.post("/fs/move", status_code=204, response_class=Response, summary="Rename")
    async def move(sandbox_id: str, body: MoveRequest) -> Response:
        await plane.move(sandbox_id, check_sandbox_path(body.src), check_sandbox_path(body.dst))
        return Response(status_code=204)

    @router.post("/fs/chmod", status_code=204, response_class=Response, summary="chmod")
    async def chmod(sandbox_id: str, body: ChmodRequest) -> Response:
        await plane.chmod(sandbox_id, check_sandbox_path(body.path), body.mode)
        return Response(status_code=204)

    @router.get(
        "/archive",
        response_class=StreamingResponse,
        responses={200: {"content": {_TAR: {}}}},
        summary="Download a directory as a tar stream",
    )
    async def download(sandbox_id: str, path: str) -> Response:
        chunks = await plane.download(sandbox_id, check_sandbox_path(path))
        return StreamingResponse(chunks, media_type=_TAR)

    @router.put(
        "/archive",
        summary="Upload a tar stream into a directory",
        openapi_extra={"requestBody": {"required": True, "content": {_TAR: {"schema": {}}}}},
    )
    async def upload(request: Request, sandbox_id: str, path: str) -> Response:
        """Members must stay below `path`: absolute names, `..` and outside links are 422."""
        set_body_limit(request, limits.max_import_bytes, "archive")
        stats = await plane.upload(sandbox_id, check_sandbox_path(path), nonempty(request.stream()))
        return Response(json.dumps(stats.__dict__), media_type="application/json", status_code=200)

    return router


def stream_router(plane: DataPlane, limits: ApiLimits, auth: Callable[..., object]) -> APIRouter:
    """Streamed file content (edge routes only; the apiserver has its buffered twins)."""
    router = APIRouter(
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
        tags=["files"],
    )

    @router.get(
        "/files",
        response_class=StreamingResponse,
        responses={200: {"content": {_OCTET: {}}}},
        summary="Read a file (streamed)",
    )
    async def read_file(sandbox_id: str, path: str) -> Response:
        chunks = await plane.read_stream(sandbox_id, check_sandbox_path(path))
        return StreamingResponse(chunks, media_type=_OCTET)

    @router.put(
        "/files",
        status_code=204,
        response_class=Response,
        summary="Write a file (streamed, atomic)",
        openapi_extra={"requestBody": {"required": True, "content": {_OCTET: {"schema": {}}}}},
    )
    async def write_file(
        request: Request, sandbox_id: str, path: str, mode: str = "644"
    ) -> Response:
        perms = parse_mode(mode)
        set_body_limit(request, limits.max_stream_bytes, "file")
        await plane.write_stream(
            sandbox_id, check_sandbox_path(path), nonempty(request.stream()), mode=perms
        )
        return Response(status_code=204)

    return router


def desktop_router(plane: DataPlane, auth: Callable[..., object]) -> APIRouter:
    """Computer use of one sandbox (a backend with a display: dsec.edge.desktop)."""
    from dsec.edge import desktop

    router = APIRouter(
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
        tags=["desktop"],
    )

    @router.get(
        "/desktop/screenshot",
        response_class=Response,
        responses={200: {"content": {"image/png": {}}}},
        summary="The screen as PNG",
    )
    async def screenshot(sandbox_id: str) -> Response:
        return Response(await desktop.screenshot(plane.edge, sandbox_id), media_type="image/png")

    @router.post(
        "/desktop/input", status_code=204, response_class=Response, summary="Mouse or keys"
    )
    async def computer_input(sandbox_id: str, body: ComputerAction) -> Response:
        """One action: mouse_move, left/right/middle/double_click, scroll, write, press."""
        await desktop.computer_input(plane.edge, sandbox_id, body)
        return Response(status_code=204)

    return router


def snapshot_router(plane: DataPlane, auth: Callable[..., object]) -> APIRouter:
    """A running VM saved as a VM image (a backend with snapshots: dsec.edge.vmsnapshot)."""
    from dsec.edge import vmsnapshot

    router = APIRouter(
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
        tags=["sandboxes"],
    )

    @router.post(
        "/snapshot", status_code=201, response_model=ImageInfo, summary="Save as a VM image"
    )
    async def snapshot(sandbox_id: str, body: SnapshotRequest) -> Response:
        """Memory and disk, consistent (the VM frozen across both); 409 if the name exists."""
        info = await vmsnapshot.snapshot(plane.edge, sandbox_id, body.ref)
        return model_response(info, status_code=201)

    return router


def install_data_path(
    app: FastAPI,
    plane: DataPlane,
    keys: KeyVerifier,
    api_auth: Authenticator,
    limits: ApiLimits,
    access: SandboxAccess | None = None,
) -> None:
    access = access or SandboxAccess(plane.edge, None, api_auth)
    data_auth = DataAuth(keys, plane, access)
    # Every token is minted for a sandbox the caller may use (404 for another's).
    runtime = Depends(access.runtime)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/token",
        response_model=DataPathInfo,
        tags=["sandboxes"],
        summary="Get a data-path token",
        dependencies=[runtime],
    )
    async def token(sandbox_id: str) -> Response:
        """A fresh per-sandbox token and the edge URL that accepts it."""
        return model_response(await plane.data_path(check_sandbox_id(sandbox_id)))

    @app.post(
        VIEW_TOKEN_PATH,
        response_model=DataPathInfo,
        tags=["sandboxes"],
        summary="Get a live-view-only token",
        dependencies=[runtime],
    )
    async def view_token(sandbox_id: str) -> Response:
        """A short-lived token (``dsv1``) that opens only the sandbox's live view
        WebSocket: what the dashboard's session cookie may mint (no commands, no files)."""
        sid = check_sandbox_id(sandbox_id)
        return model_response(await plane.data_path(sid, scope="view"))

    prefix = EDGE_PREFIX + "/{sandbox_id}"
    app.include_router(stream_router(plane, limits, data_auth), prefix=prefix)
    app.include_router(file_router(plane, limits, data_auth), prefix=prefix)
    app.include_router(desktop_router(plane, data_auth), prefix=prefix)
    app.include_router(snapshot_router(plane, data_auth), prefix=prefix)
    app.include_router(
        file_router(plane, limits, access.runtime), prefix="/v1/sandboxes/{sandbox_id}"
    )

    @app.websocket(RPC_PATH)
    async def rpc(ws: WebSocket) -> None:
        """Multiplexed commands, sessions and streams (see ``dsec.api.datapath``).

        The handshake needs a credential (``Authorization: Bearer``): an API key, which
        makes every frame trusted, or a sandbox token, after which each frame still
        carries the token of its own sandbox. Without one the upgrade is refused with
        a typed 401 before any frame is read."""
        credential = _header_credential(ws)
        try:
            principal = await data_auth.handshake(credential)
        except DSecError as exc:
            await refuse_handshake(ws, exc)
            return
        await ws.accept()
        await RpcConnection(ws, plane, principal=principal, access=access).serve()

    @app.websocket(prefix + "/pty")
    async def pty(
        ws: WebSocket,
        sandbox_id: str,
        token: str | None = None,
        rows: Annotated[int, Query(ge=1, le=0xFFFF)] = 24,
        cols: Annotated[int, Query(ge=1, le=0xFFFF)] = 80,
        command: str | None = None,
        term: str = "xterm-256color",
    ) -> None:
        """An interactive terminal: binary frames are keystrokes and screen output, text
        frames ``{"type": "resize", "rows", "cols"}``; the edge ends with
        ``{"type": "exit", "exit_code"}`` (or ``{"type": "error", ...}``)."""
        await ws.accept()
        try:
            await data_auth.check(check_sandbox_id(sandbox_id), token or _header_credential(ws))
            args = CommandArgs(
                command=command or ["/bin/sh"], env={"TERM": term[:64]}, keep_stdin=True
            )
            proc = await plane.start(sandbox_id, args, background=False, pty=(rows, cols))
        except DSecError as exc:
            await close_with_error(ws, exc)
            return
        from dsec.apiserver.rpc import serve_pty

        await serve_pty(ws, proc, PtyControl)

    views = LiveViews(plane.edge)

    @app.websocket(prefix + "/desktop/vnc")
    async def vnc(ws: WebSocket, sandbox_id: str, token: str | None = None) -> None:
        """The live view: the sandbox's VNC server (RFB), binary frames both ways.

        ``?token=`` (a browser's WebSocket cannot set headers) or ``Authorization``;
        a wrong credential, a sandbox not running, a backend without a display or too
        many viewers refuse the upgrade itself with the typed error. Offers of the
        ``binary`` subprotocol (older noVNC, websockify) are answered with it."""
        try:
            await data_auth.check(
                check_sandbox_id(sandbox_id), token or _header_credential(ws), scope="view"
            )
            link = await views.open(sandbox_id)
        except DSecError as exc:
            await refuse_handshake(ws, exc)
            return
        offered = ws.scope.get("subprotocols") or []
        try:
            await ws.accept(subprotocol="binary" if "binary" in offered else None)
        except BaseException:
            views.release(link)
            raise

        async def receive() -> bytes | None:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return None
                if msg.get("bytes"):
                    return bytes(msg["bytes"])

        await views.relay(link, receive, ws.send_bytes)
        with contextlib.suppress(Exception):
            await ws.close()
