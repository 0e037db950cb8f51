"""One data-path WebSocket: requests multiplexed by id, output as binary frames.

Each request runs in its own task, so a long command never delays a short one on the
same connection. Closing the connection (or ``cancel``) abandons the requests in flight:
their foreground commands are killed with their whole process tree; background ones
keep running and stay reachable by id from any connection.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from dsec.api.datapath import PtyControl, encode_data
from dsec.api.exec import CommandArgs, SessionArgs, signal_number
from dsec.api.files import ChmodRequest, MkdirRequest, MoveRequest, RemoveRequest
from dsec.apiserver.errors import validation_message
from dsec.apiserver.params import INT64_MAX, MAX_LIST_LIMIT, check_sandbox_id
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.wsmux import MuxConnection, close_with_error, error_payload
from dsec.edge.dataplane import DataPlane, check_path
from dsec.errors import DSecError, InvalidArgument, PayloadTooLarge, Unauthenticated
from dsec.sessions.processes import ManagedProcess

Handler = Callable[["RpcConnection", int, str, dict[str, Any]], Awaitable[Any]]


def _arg(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"args.{key}: a non-empty string is required")
    return value


class RpcConnection(MuxConnection):
    kind = "data path"

    def __init__(
        self, ws: WebSocket, plane: DataPlane, *, principal: str | None, access: SandboxAccess
    ) -> None:
        """``principal``: the API key's (each frame's sandbox checked against it by
        ``access``); None: a token connection, each frame carries its sandbox's token."""
        super().__init__(ws)
        self.plane = plane
        self.principal = principal
        self.access = access

    async def answer(self, rid: int, op: str, msg: dict[str, Any]) -> Any:
        handler = HANDLERS.get(op)
        if handler is None:
            raise InvalidArgument(f"unknown op {op!r}; one of {sorted(HANDLERS)}")
        sandbox_id = check_sandbox_id(str(msg.get("sandbox", "")))
        if self.principal is not None:  # an API key: its principal may use the sandbox
            await self.access.require(self.principal, sandbox_id)
        else:
            token = msg.get("token")
            if not isinstance(token, str) or not token:
                raise Unauthenticated("a sandbox token is required (field 'token')")
            self.plane.authorize(sandbox_id, token)
        args = msg.get("args") or {}
        if not isinstance(args, dict):
            raise InvalidArgument("args must be a JSON object")
        return await handler(self, rid, sandbox_id, args)

    async def stream_output(self, rid: int, proc: ManagedProcess, start: int, trim: bool) -> None:
        async for fd, data in proc.output(start, trim=trim):
            await self.send_bytes(encode_data(rid, fd, data))


# ---- handlers --------------------------------------------------------------------------


async def _run(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    proc = await conn.plane.start(sid, CommandArgs.model_validate(args), background=False)
    try:
        await conn.stream_output(rid, proc, 0, True)
        return await proc.wait()
    finally:
        if proc.running:  # cancelled: the caller gave up, so the command goes too
            await asyncio.shield(proc.abandon())


async def _start(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    proc = await conn.plane.start(sid, CommandArgs.model_validate(args), background=True)
    return proc.info()


def _proc(conn: RpcConnection, sid: str, args: dict[str, Any]) -> ManagedProcess:
    return conn.plane.process(sid, _arg(args, "process"))


async def _attach(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    proc = _proc(conn, sid, args)
    start = args.get("start", 0)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= INT64_MAX:
        raise InvalidArgument("args.start must be a chunk index >= 0")
    await conn.stream_output(rid, proc, start, False)
    return await proc.wait()


async def _wait(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return await _proc(conn, sid, args).wait()


async def _stdin(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    proc = _proc(conn, sid, args)
    data = b""
    if "data" in args:
        try:
            data = base64.b64decode(str(args["data"]), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("args.data must be base64") from None
    elif "text" in args:
        data = str(args["text"]).encode()
    await proc.write_stdin(data, close=bool(args.get("close", False)))
    return {}


async def _signal(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    proc = _proc(conn, sid, args)
    try:
        signo = signal_number(args.get("signal", "terminate"))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    await proc.send_signal(signo)
    return {}


async def _kill(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return await _proc(conn, sid, args).kill()


async def _process(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return _proc(conn, sid, args).info()


async def _processes(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return conn.plane.processes(sid)


async def _session_open(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return await conn.plane.open_session(sid, SessionArgs.model_validate(args))


async def _session_close(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return await conn.plane.close_session(sid, _arg(args, "session"))


async def _sessions(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return conn.plane.sessions(sid)


async def _ping(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    conn.plane.edge.running_record(sid)
    return {}


async def _stat(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    return await conn.plane.stat(
        sid, check_path(_arg(args, "path")), follow=bool(args.get("follow"))
    )


async def _list(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    limit = args.get("limit")
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIST_LIMIT
    ):
        raise InvalidArgument(f"args.limit must be an integer from 1 to {MAX_LIST_LIMIT}")
    return await conn.plane.list_dir(
        sid,
        check_path(_arg(args, "path")),
        recursive=bool(args.get("recursive")),
        limit=limit,
    )


async def _mkdir(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    req = MkdirRequest.model_validate(args)
    await conn.plane.mkdir(sid, check_path(req.path), parents=req.parents, mode=req.mode)
    return {}


async def _remove(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    req = RemoveRequest.model_validate(args)
    await conn.plane.remove(sid, check_path(req.path), recursive=req.recursive)
    return {}


async def _move(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    req = MoveRequest.model_validate(args)
    await conn.plane.move(sid, check_path(req.src, "src"), check_path(req.dst, "dst"))
    return {}


async def _chmod(conn: RpcConnection, rid: int, sid: str, args: dict[str, Any]) -> Any:
    req = ChmodRequest.model_validate(args)
    await conn.plane.chmod(sid, check_path(req.path), req.mode)
    return {}


HANDLERS: dict[str, Handler] = {
    "run": _run,
    "start": _start,
    "attach": _attach,
    "wait": _wait,
    "stdin": _stdin,
    "signal": _signal,
    "kill": _kill,
    "process": _process,
    "processes": _processes,
    "session.open": _session_open,
    "session.close": _session_close,
    "sessions": _sessions,
    "ping": _ping,
    "fs.stat": _stat,
    "fs.list": _list,
    "fs.mkdir": _mkdir,
    "fs.remove": _remove,
    "fs.move": _move,
    "fs.chmod": _chmod,
}


MAX_CONTROL_CHARS = 4096  # a resize is ~40 characters


def parse_control(text: str, control: type[PtyControl]) -> PtyControl | None:
    """A terminal's text frame: a resize, None for a JSON object of another type (a
    newer client's message, ignored like an unknown escape), else a typed error."""
    if len(text) > MAX_CONTROL_CHARS:
        raise PayloadTooLarge(f"terminal control frames are limited to {MAX_CONTROL_CHARS} chars")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument("a terminal text frame must be a JSON object") from None
    if not isinstance(obj, dict):
        raise InvalidArgument("a terminal text frame must be a JSON object")
    if obj.get("type") != "resize":
        return None
    try:
        return control.model_validate(obj)
    except ValidationError as exc:
        raise InvalidArgument(validation_message(exc.errors())) from None


async def serve_pty(ws: WebSocket, proc: ManagedProcess, control: type[PtyControl]) -> None:
    """Pump a terminal both ways until the command ends or the client goes away."""

    async def to_client() -> None:
        async for _fd, data in proc.output(trim=True):
            await ws.send_bytes(data)
        try:
            status = await proc.wait()
            await ws.send_text(json.dumps({"type": "exit", **status.model_dump()}))
        except DSecError as exc:
            await ws.send_text(json.dumps({"type": "error", "error": error_payload(exc)}))
        await ws.close(1000)

    pump = asyncio.create_task(to_client())
    try:
        while not pump.done():
            receive = asyncio.ensure_future(ws.receive())
            done, _ = await asyncio.wait({receive, pump}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                receive.cancel()
                break
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                break
            if message.get("bytes"):
                await proc.write_stdin(message["bytes"])
            elif message.get("text"):
                try:
                    ctl = parse_control(message["text"], control)
                except DSecError as exc:  # garbage, not a newer client: hang up, typed
                    await close_with_error(ws, exc)
                    break
                if ctl is not None:
                    await proc.resize(ctl.rows, ctl.cols)
    except (WebSocketDisconnect, RuntimeError, DSecError):
        pass
    finally:
        if proc.running:
            await proc.abandon()
        if not pump.done():
            pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump
