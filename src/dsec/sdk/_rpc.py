"""One multiplexed data-path WebSocket from the SDK to an edge (protocol: ``dsec.api.datapath``).

A reader task routes answers to the waiting callers by request id and output frames to
their ``on_data`` callbacks, so any number of commands share one connection. A dropped
connection fails the calls in flight with ``PlatformUnavailable``; the next call opens
a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from dsec.api.datapath import RPC_PATH, decode_data
from dsec.errors import DSecError, PlatformUnavailable, error_from_payload

OnData = Callable[[int, bytes], None]

#: Largest frame accepted from the edge (output frames are at most 64 KiB + header).
MAX_FRAME = 64 << 20


def ws_url(http_url: str, path: str) -> str:
    if http_url.startswith("https://"):
        return "wss://" + http_url.removeprefix("https://").rstrip("/") + path
    return "ws://" + http_url.removeprefix("http://").rstrip("/") + path


def _refusal(exc: BaseException) -> DSecError | None:
    """The typed error of a handshake the server refused with an error envelope."""
    if not isinstance(exc, InvalidStatus) or exc.response.status_code < 400:
        return None
    try:
        payload = json.loads(exc.response.body or b"")
    except ValueError:
        return None
    if not isinstance(payload, dict) or "error" not in payload:
        return None
    return error_from_payload(exc.response.status_code, payload)


class RpcClient:
    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        open_timeout: float = 10.0,
        path: str = RPC_PATH,
        max_size: int | None = MAX_FRAME,
    ):
        self.base_url = base_url
        self._headers = headers
        self._open_timeout = open_timeout
        self._path = path  # another endpoint of the same framing (FNCALL_RPC_PATH)
        self._max_size = max_size  # None: answers as large as an HTTP body may be
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], OnData | None]] = {}
        self._connecting: asyncio.Lock | None = None

    def set_credential(self, credential: str) -> None:
        """The bearer credential of the next handshake (an open socket keeps going)."""
        self._headers["Authorization"] = f"Bearer {credential}"

    async def _connection(self) -> ClientConnection:
        if self._ws is not None:
            return self._ws
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._ws is None:
                url = ws_url(self.base_url, self._path)
                try:
                    ws = await connect(
                        url,
                        additional_headers=self._headers,
                        compression=None,
                        max_size=self._max_size,
                        open_timeout=self._open_timeout,
                        ping_interval=20,
                        ping_timeout=60,
                    )
                except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
                    refused = _refusal(exc)
                    if refused is not None:  # the typed answer of a refused handshake
                        raise refused from None
                    raise PlatformUnavailable(
                        f"cannot open the data path to {url}: {exc or type(exc).__name__}",
                        url=url,
                    ) from exc
                self._ws = ws
                self._reader = asyncio.create_task(self._read(ws), name="dsec-rpc-reader")
        assert self._ws is not None
        return self._ws

    async def _read(self, ws: ClientConnection) -> None:
        reason: DSecError = PlatformUnavailable(f"lost the data path to {self.base_url}")
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    rid, stream, data = decode_data(message)
                    entry = self._pending.get(rid)
                    if entry is not None and entry[1] is not None:
                        entry[1](stream, data)
                    continue
                msg = json.loads(message)
                if msg.get("type") == "error":  # the edge refused the whole connection
                    reason = error_from_payload(0, msg)
                    break
                entry = self._pending.pop(int(msg.get("id", 0)), None)
                if entry is None or entry[0].done():
                    continue
                if "error" in msg:
                    entry[0].set_exception(error_from_payload(0, msg))
                else:
                    entry[0].set_result(msg.get("result"))
        except ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            pending, self._pending = self._pending, {}
            for fut, _ in pending.values():
                if not fut.done():
                    fut.set_exception(reason)

    async def call(
        self,
        op: str,
        sandbox_id: str,
        args: dict[str, Any],
        *,
        token: str | None = None,
        on_data: OnData | None = None,
    ) -> Any:
        """Send one request and wait for its answer; cancelling tells the edge to abandon
        it (a foreground command is then killed)."""
        ws = await self._connection()
        reader = self._reader
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, on_data)
        msg: dict[str, Any] = {"id": rid, "op": op, "sandbox": sandbox_id, "args": args}
        if token is not None:
            msg["token"] = token
        try:
            await ws.send(json.dumps(msg))
            return await fut
        except ConnectionClosed as exc:
            # An edge that refuses the connection sends why, then closes: the reader
            # fails every pending call with that typed error. Prefer it to a bare
            # "lost", also when the close overtook our send.
            if reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(reader), 2)
            refused = fut.exception() if fut.done() and not fut.cancelled() else None
            if refused is not None:
                raise refused from exc
            raise PlatformUnavailable(f"lost the data path to {self.base_url}") from exc
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None and self._ws is ws:
                with contextlib.suppress(ConnectionClosed):
                    await asyncio.shield(ws.send(json.dumps({"id": rid, "op": "cancel"})))
            raise
        finally:
            self._pending.pop(rid, None)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
