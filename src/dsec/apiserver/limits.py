"""Request body caps, enforced while the body streams in.

Uvicorn accepts bodies of any size, so without a cap one garbage request could fill the
server's memory. JSON bodies get a small default cap; the streaming routes (file upload,
image import) raise their own cap for their request before reading it.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.apiserver.errors import BodyTooLarge
from dsec.errors import PayloadTooLarge

MiB = 1024 * 1024
GiB = 1024 * MiB

_SCOPE_KEY = "dsec.max_body_bytes"


@dataclass(frozen=True)
class ApiLimits:
    """Size limits of the HTTP API (bytes)."""

    max_json_bytes: int = 80 * MiB  # exec stdin may be large; ExecRequest caps output at 64 MiB
    max_file_bytes: int = 256 * MiB  # one file read from or written into a sandbox
    max_import_bytes: int = 64 * GiB  # one image archive
    # A file streamed into a sandbox (constant memory: only the sandbox's disk bounds it).
    max_stream_bytes: int = 64 * GiB
    # A file write that is a trajectory step: logged whole (base64 in the step log).
    max_step_file_bytes: int = 32 * MiB


def _human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def too_large(limit: int, what: str = "request body") -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} is larger than the limit of {_human(limit)}", limit_bytes=limit)


def set_body_limit(request: Request, limit: int, what: str) -> None:
    """Give this request a cap other than the JSON default; call before reading the body.

    A declared Content-Length over the cap fails at once, before any byte is read.
    """
    request.scope[_SCOPE_KEY] = (limit, what)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, what)


class BodyLimitMiddleware:
    """Count request body bytes and stop at the cap of the request (pure ASGI, cheap)."""

    def __init__(self, app: ASGIApp, *, default_limit: int) -> None:
        self.app = app
        self.default_limit = default_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        checked_length = False

        async def receive_capped() -> Message:
            nonlocal received, checked_length
            limit, what = scope.get(_SCOPE_KEY, (self.default_limit, "request body"))
            if not checked_length:
                checked_length = True
                for name, value in scope["headers"]:
                    if name == b"content-length":
                        if value.isdigit() and int(value) > limit:
                            raise BodyTooLarge(too_large(limit, what))
                        break
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(too_large(limit, what))
            return message

        await self.app(scope, receive_capped, send)
