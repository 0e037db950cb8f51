"""Connect-RPC framing for the JSON codec, sans I/O (what envd's clients speak).

The `e2b` SDK talks to envd with connectrpc and a JSON codec: unary calls are a plain
``application/json`` POST answered with JSON or a Connect error (``{"code", "message"}``
with the HTTP status of the code); server streams send one enveloped request
(``application/connect+json``) and get envelopes back, each a flag byte and a 4-byte
big-endian length, closed by an end-of-stream envelope (flag 0x02) carrying ``{}`` or
``{"error": {...}}``. Errors of a stream travel in that last envelope with HTTP 200.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from dsec.errors import DSecError

STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Connect code -> HTTP status of a unary error (connectrpc.com/docs/protocol).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """An error to answer with a Connect code (the SDK maps codes to its exceptions)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def connect_code(exc: DSecError) -> str:
    """Our typed error as the Connect code the SDK turns into the matching exception."""
    status = exc.status
    if exc.code == "already_exists":
        return "already_exists"
    if exc.code == "sandbox_not_running":
        return "unavailable"
    if status == 404:
        return "not_found"
    if status == 401:
        return "unauthenticated"
    if status == 403:
        return "permission_denied"
    if status in (400, 413, 422):
        return "invalid_argument"
    if status == 409:
        return "failed_precondition"
    if status == 429:
        return "resource_exhausted"
    if status == 501:
        return "unimplemented"
    if status in (503, 507):
        return "unavailable"
    return "internal"


def as_connect_error(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, DSecError):
        return ConnectError(connect_code(exc), exc.message)
    return ConnectError("internal", "internal error")


def error_body(err: ConnectError) -> bytes:
    return json.dumps({"code": err.code, "message": err.message}).encode()


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def message_envelope(message: dict[str, Any]) -> bytes:
    return envelope(json.dumps(message, separators=(",", ":")).encode())


def end_stream(err: ConnectError | None = None) -> bytes:
    body: dict[str, Any] = {}
    if err is not None:
        body["error"] = {"code": err.code, "message": err.message}
    return envelope(json.dumps(body).encode(), FLAG_END_STREAM)


def decode_json(data: bytes) -> dict[str, Any]:
    """A request message; anything but a JSON object is invalid_argument."""
    try:
        value = json.loads(data) if data else {}
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"request is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", "request must be a JSON object")
    return value


def decode_stream_request(data: bytes) -> dict[str, Any]:
    """The single enveloped message of a server-streaming request."""
    if len(data) < 5:
        raise ConnectError("invalid_argument", "streaming request without an envelope")
    flags, length = struct.unpack(">BI", data[:5])
    if flags & FLAG_COMPRESSED:
        raise ConnectError("unimplemented", "compressed messages are not supported")
    if length > MAX_MESSAGE_BYTES or len(data) < 5 + length:
        raise ConnectError("invalid_argument", "truncated or oversized envelope")
    return decode_json(data[5 : 5 + length])
