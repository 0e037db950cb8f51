"""The QEMU guest agent protocol (qemu-ga), host side, with the guest treated as hostile.

Why qemu-ga and not our own agent: a full VM runs any OS from its own disk image, and
the standard agent is what Linux distributions and Windows already ship. It speaks
QMP-style JSON over the virtio-serial port ``org.qemu.guest_agent.0``, one request at
a time: ``{"execute": ..., "arguments": ...}`` in, one line ``{"return": ...}`` or
``{"error": {"desc": ...}}`` out.

Keeping the stream in step (the protocol reference's rule): on every new connection
and after any failure, ``guest-sync-delimited`` with a fresh id, preceded by a 0xFF
byte that flushes the agent's parser; the agent puts 0xFF before its answer, and
everything up to that sentinel (stale answers, the parse error the flush itself
causes) is thrown away, then answers are ignored until the one carrying our id.

Bounds, because everything that comes back was written by the guest: one answer line
is at most ``MAX_LINE`` bytes, a resync throws away at most ``MAX_DISCARD`` bytes, a
JSON document that is not an object or is nested absurdly is a protocol error, every
field read is type-checked and base64 is decoded strictly, and every call has a
deadline. Any protocol error drops the connection (the next call reconnects and
syncs): a hostile agent can fail its own sandbox's requests, never hang or crash the
edge. ``ReplyDecoder`` is the sans-IO part (unit-tested without QEMU).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from dsec.errors import BackendError
from dsec.linux import socket_path_nofollow

log = logging.getLogger(__name__)

SENTINEL = 0xFF
# One answer: qemu-ga keeps up to 16 MiB of each output stream of a command, and a
# guest-exec-status answer carries both, base64-encoded (4/3): what a real agent may
# send, and so what a hostile one can make the edge hold per call, at most.
MAX_LINE = 48 << 20
MAX_DISCARD = 16 << 20  # stale bytes skipped while resyncing
MAX_ERROR_TEXT = 500  # of the guest's error description kept in a message
READ_SIZE = 64 << 10  # bytes per socket read


class GuestAgentError(BackendError):
    """The guest agent broke the protocol, did not answer in time, or is not there."""


class GuestCommandError(BackendError):
    """The guest agent answered a command with an error (its ``desc``, cut short)."""


class ReplyDecoder:
    """Splits the agent's byte stream into answers (sans-IO).

    ``feed`` bytes in, ``next_reply`` takes one complete answer out (None: need more).
    A 0xFF byte anywhere resets the parser (it is the agent's sentinel); after
    ``expect_sentinel`` every byte up to the next 0xFF is stale and dropped.
    """

    def __init__(self, *, max_line: int = MAX_LINE, max_discard: int = MAX_DISCARD) -> None:
        self.max_line = max_line
        self.max_discard = max_discard
        self._buf = bytearray()
        self._await_sentinel = False
        self._discarded = 0

    def expect_sentinel(self) -> None:
        """A sync was sent: what comes before the agent's 0xFF is stale."""
        self._await_sentinel = True
        self._discarded = 0

    def feed(self, data: bytes) -> None:
        self._buf += data
        if self._await_sentinel:
            self._skip_to_sentinel()

    def _skip_to_sentinel(self) -> None:
        i = self._buf.rfind(SENTINEL)
        if i < 0:
            self._discard(len(self._buf))
            return
        self._discard(i + 1)
        self._await_sentinel = False

    def _discard(self, n: int) -> None:
        self._discarded += n
        del self._buf[:n]
        if self._discarded > self.max_discard:
            raise GuestAgentError(
                f"the guest agent sent more than {self.max_discard} bytes before answering a sync"
            )

    def next_reply(self) -> dict[str, Any] | None:
        """The next complete answer as a dict with "return" or "error", or None."""
        while not self._await_sentinel:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > self.max_line:
                    raise GuestAgentError(
                        f"the guest agent sent an answer longer than {self.max_line} bytes"
                    )
                return None
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            reset = line.rfind(bytes([SENTINEL]))
            if reset >= 0:  # the parser was flushed mid-line: what follows is new
                line = line[reset + 1 :]
            if end > self.max_line:
                raise GuestAgentError(
                    f"the guest agent sent an answer longer than {self.max_line} bytes"
                )
            if line.strip():
                return parse_reply(line)
        return None


def parse_reply(line: bytes) -> dict[str, Any]:
    """One answer line as a dict holding "return" or "error"; GuestAgentError else."""
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise GuestAgentError(f"the guest agent sent an answer that is not JSON: {exc}") from None
    if not isinstance(doc, dict) or ("return" not in doc and "error" not in doc):
        raise GuestAgentError("the guest agent sent JSON that is not an answer")
    return doc


def _error_text(error: object) -> str:
    desc = error.get("desc") if isinstance(error, dict) else None
    text = desc if isinstance(desc, str) else "unknown error"
    return text[:MAX_ERROR_TEXT]


def b64(value: object, what: str, limit: int) -> bytes:
    """Strictly decoded base64 of at most ``limit`` bytes (GuestAgentError else)."""
    if value is None:
        return b""
    if not isinstance(value, str) or len(value) > (limit + 2) // 3 * 4:
        raise GuestAgentError(f"the guest agent sent a bad or oversized {what}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise GuestAgentError(f"the guest agent sent {what} that is not base64") from None


def field(doc: object, key: str, kind: type, what: str) -> Any:
    """``doc[key]`` if ``doc`` is a dict and the value has type ``kind`` (bool is not
    an int here), else GuestAgentError."""
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GuestAgentError(f"the guest agent's answer to {what} lacks a valid {key!r}")
    return value


def integer(value: object, what: str) -> int:
    """``value`` if it is an int (not a bool), else GuestAgentError naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise GuestAgentError(f"the guest agent sent no valid {what}")
    return value


class GuestAgent:
    """One connection to a VM's guest agent chardev (a unix socket QEMU serves). Calls
    are serialised: the protocol has no request ids."""

    def __init__(self, socket: Path, *, max_line: int = MAX_LINE) -> None:
        self.socket = socket
        self.max_line = max_line
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._decoder = ReplyDecoder(max_line=max_line)
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def call(
        self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float = 10.0
    ) -> Any:
        """The agent's "return" for ``command``; GuestCommandError for its "error",
        GuestAgentError when it broke the protocol or did not answer in time."""
        async with self._lock:
            deadline = time.monotonic() + timeout
            try:
                if self._writer is None:
                    await self._open(deadline)
                reply = await self._roundtrip(command, arguments, deadline)
            except GuestAgentError:
                await self._drop()
                raise
            except (OSError, EOFError) as exc:
                await self._drop()
                raise GuestAgentError(
                    f"guest agent connection lost during {command}: {exc}"
                ) from exc
            except BaseException:
                await self._drop()  # cancelled mid-answer: the stream is out of step
                raise
        if "error" in reply:
            raise GuestCommandError(
                f"the guest agent refused {command}: {_error_text(reply['error'])}"
            )
        return reply["return"]

    async def sync(self, timeout: float) -> None:
        """Connect (again) and bring the stream in step; GuestAgentError on failure."""
        async with self._lock:
            await self._drop()
            try:
                await self._open(time.monotonic() + timeout)
            except BaseException:
                await self._drop()
                raise

    async def wait_ready(self, timeout: float, *, attempt: float = 3.0) -> None:
        """Until the agent in the guest answers a sync (it starts late in the boot):
        each attempt on a fresh connection, so a sync the guest never saw is gone."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                await self.sync(max(0.1, min(attempt, left)))
                return
            except GuestAgentError as exc:
                if time.monotonic() >= deadline:
                    raise GuestAgentError(
                        f"the guest agent did not answer within {timeout:g}s: {exc}"
                    ) from exc
            await asyncio.sleep(0.1)

    async def _open(self, deadline: float) -> None:
        try:
            with socket_path_nofollow(self.socket) as safe:  # QEMU can write its directory
                self._reader, self._writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(safe),
                    max(0.01, deadline - time.monotonic()),
                )
        except (OSError, TimeoutError) as exc:
            raise GuestAgentError(
                f"cannot connect to the guest agent at {self.socket}: {exc}"
            ) from exc
        self._decoder = ReplyDecoder(max_line=self.max_line)
        ident = secrets.randbelow(1 << 31)
        self._decoder.expect_sentinel()
        self._send(b"\xff" + _request("guest-sync-delimited", {"id": ident}))
        while True:
            reply = await self._read(deadline, "guest-sync-delimited")
            if reply.get("return") == ident:
                return

    async def _roundtrip(
        self, command: str, arguments: dict[str, Any] | None, deadline: float
    ) -> dict[str, Any]:
        self._send(_request(command, arguments))
        return await self._read(deadline, command)

    def _send(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.write(data)

    async def _read(self, deadline: float, what: str) -> dict[str, Any]:
        assert self._reader is not None and self._writer is not None
        await self._writer.drain()
        while True:
            reply = self._decoder.next_reply()
            if reply is not None:
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise GuestAgentError(f"the guest agent did not answer {what} in time")
            try:
                data = await asyncio.wait_for(self._reader.read(READ_SIZE), left)
            except TimeoutError:
                raise GuestAgentError(f"the guest agent did not answer {what} in time") from None
            if not data:
                raise GuestAgentError(f"the guest agent's port closed during {what}")
            self._decoder.feed(data)


def _request(command: str, arguments: dict[str, Any] | None) -> bytes:
    doc: dict[str, Any] = {"execute": command}
    if arguments is not None:
        doc["arguments"] = arguments
    return json.dumps(doc).encode() + b"\n"
