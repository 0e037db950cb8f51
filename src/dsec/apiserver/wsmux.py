"""Requests multiplexed by id on one WebSocket: the loop both RPC sockets share.

Each request runs in its own task and is answered when it finishes, in any order, so a
long request never delays a short one. ``cancel`` (or the client going away) cancels
requests in flight. What a request does is the subclass's ``answer``; every error it
raises reaches the client as a typed error frame, never a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from dsec.apiserver.errors import error_response, validation_message
from dsec.apiserver.frames import FatalFrame, parse_request
from dsec.errors import DSecError, InvalidArgument

log = logging.getLogger("dsec.apiserver.wsmux")


def error_payload(exc: DSecError) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message, "details": exc.details}


async def close_with_error(ws: WebSocket, exc: DSecError) -> None:
    """Tell the client why (a JSON text frame), then close with code 4000 + HTTP status."""
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps({"type": "error", "error": error_payload(exc)}, default=str))
        await ws.close(code=4000 + exc.status, reason=exc.code[:100])


async def refuse_handshake(ws: WebSocket, exc: DSecError) -> None:
    """Refuse the upgrade itself: the typed error as the HTTP answer where the server
    can send one (the websocket.http.response extension), else a bare 403."""
    with contextlib.suppress(Exception):
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(error_response(exc))
        else:
            await ws.close(code=4000 + exc.status, reason=exc.code[:100])


def dump(value: Any) -> str:
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "[" + ",".join(v.model_dump_json() for v in value) + "]"
    return json.dumps(value, default=str)


class MuxConnection:
    """One client's socket; subclasses implement ``answer``."""

    kind = "request"  # names the socket in the server log

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._side: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    async def answer(self, rid: int, op: str, msg: dict[str, Any]) -> Any:
        """The result of one request (a model, a list of models or JSON data)."""
        raise NotImplementedError

    async def send_text(self, text: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(text)

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    async def serve(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    continue  # no binary requests (yet)
                try:
                    self._dispatch(text)
                except FatalFrame as exc:  # a frame no client of ours sends: hang up
                    await close_with_error(self.ws, exc.error)
                    return
        except WebSocketDisconnect:
            return
        finally:  # the client is gone: what it asked for is abandoned
            for task in list(self._tasks.values()):
                task.cancel()

    def _dispatch(self, text: str) -> None:
        try:
            rid, op, msg = parse_request(text)
        except InvalidArgument as err:  # a client bug: say so, the connection goes on
            side = asyncio.create_task(self._reply_error(0, err))
            self._side.add(side)
            side.add_done_callback(self._side.discard)
            return
        if op == "cancel":
            target = self._tasks.get(rid)
            if target is not None:
                target.cancel()
            return
        handle = asyncio.create_task(self._handle(rid, op, msg))
        self._tasks[rid] = handle
        handle.add_done_callback(lambda _t: self._tasks.pop(rid, None))

    async def _reply_error(self, rid: int, exc: DSecError) -> None:
        with contextlib.suppress(Exception):  # the client went away: nobody to tell
            await self.send_text(dump({"id": rid, "error": error_payload(exc)}))

    async def _handle(self, rid: int, op: str, msg: dict[str, Any]) -> None:
        try:
            result = await self.answer(rid, op, msg)
        except asyncio.CancelledError:
            raise
        except DSecError as exc:
            await self._reply_error(rid, exc)
        except ValidationError as exc:
            await self._reply_error(rid, InvalidArgument(validation_message(exc.errors())))
        except Exception:
            log.exception("%s op %s failed", self.kind, op)
            await self._reply_error(rid, DSecError("internal error; the server log has details"))
        else:
            with contextlib.suppress(Exception):
                await self.send_text(f'{{"id":{rid},"result":{dump(result)}}}')
