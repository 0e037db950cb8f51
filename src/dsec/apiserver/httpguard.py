"""Connection guards for the HTTP servers: header timeout, header size, connection cap.

uvicorn bounds the idle time *between* requests (``timeout_keep_alive``) but not the
time a client takes to send one request's headers, nor their size, nor how many
connections it holds: a slowloris client (one header byte a second) or 10,000 idle
sockets pinned the server (the issue's finding). This protocol, uvicorn's httptools
one with three checks added, closes a connection whose headers are not complete
within ``header_timeout`` seconds, answers 431 past ``max_header_bytes``, and at
``max_connections`` first closes an idle keep-alive connection to make room, else
answers the new one with a typed 503 ``unavailable`` and closes it.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds, from the environment (every server process of the platform)."""

    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 10_000

    @classmethod
    def from_env(cls) -> ConnectionLimits:
        env = os.environ
        return cls(
            header_timeout=float(env.get("DSEC_HEADER_TIMEOUT", cls.header_timeout)),
            max_header_bytes=int(env.get("DSEC_MAX_HEADER_BYTES", cls.max_header_bytes)),
            max_connections=int(env.get("DSEC_MAX_CONNECTIONS", cls.max_connections)),
        )


def _typed(status: int, reason: str, code: str, message: str, **details: Any) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message, "details": details}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return (head + "\r\n" + body).encode()


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's ``http`` protocol class with ``limits`` applied."""
    full = _typed(
        503,
        "Service Unavailable",
        "unavailable",
        f"the server holds its limit of {limits.max_connections} connections; retry",
        limit=limits.max_connections,
    )
    too_big = _typed(
        431,
        "Request Header Fields Too Large",
        "payload_too_large",
        f"request headers are limited to {limits.max_header_bytes} bytes",
        limit_bytes=limits.max_header_bytes,
    )

    class GuardedHttpTools(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _awaiting_headers = True

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections and not self._evict_idle():
                transport.write(full)
                transport.close()
                return
            self._arm()

        def _evict_idle(self) -> bool:
            """Close one connection idle between requests (it would reconnect)."""
            for conn in self.connections:
                if isinstance(conn, GuardedHttpTools) and conn.timeout_keep_alive_task:
                    conn.timeout_keep_alive_handler()
                    self.connections.discard(conn)
                    return True
            return False

        def _arm(self) -> None:
            self._awaiting_headers = True
            if self._header_timer is None:
                self._header_bytes = 0
                self._header_timer = self.loop.call_later(
                    limits.header_timeout, self._headers_too_slow
                )

        def _disarm(self) -> None:
            self._awaiting_headers = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted once parsed: a chunk that completes the headers may carry body bytes.
            if self._awaiting_headers and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._disarm()
                    self.transport.write(too_big)
                    self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a keep-alive connection's next request: its headers are timed

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpTools
