"""``dsec store serve``: the HTTP layer store that edges on other hosts fetch from.

A bare ASGI app rather than FastAPI: lazy loading sends one range request per missing
run of chunks, so per-request overhead is what limits cold reads on a fast link; the
handful of routes below cost a dict lookup and a regex each.

Routes (``Authorization: Bearer <token>`` on all but health; a read token may only
GET/HEAD)::

    GET    /v1/health
    GET    /v1/stats                          bytes and requests served
    GET    /v1/blobs                          digests
    HEAD   /v1/blobs/sha256:<hex>             size (Content-Length), Accept-Ranges
    GET    /v1/blobs/sha256:<hex>             whole blob, or one byte range (206)
    PUT    /v1/blobs/sha256:<hex>             upload; refused unless it hashes right
    DELETE /v1/blobs/sha256:<hex>
    GET    /v1/indexes/sha256:<hex>           chunk index of a blob
    PUT    /v1/indexes/sha256:<hex>
    GET    /v1/refs                           every layer reference
    GET    /v1/refs/<name>/<version>
    PUT    /v1/refs/<name>/<version>          LayerInfo JSON; the blob must be present
    DELETE /v1/refs/<name>/<version>
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from dsec.errors import (
    DSecError,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from dsec.images.chunkindex import HEADER
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.records import LayerRecord
from dsec.net.ports import bound_port, listen

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Access = Literal["read", "write"]

BLOB_RE = re.compile(r"^/v1/(blobs|indexes)/(sha256:[0-9a-f]{64})$")
REF_RE = re.compile(r"^/v1/refs/([^/]+)/([^/]+)$")
RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
PIECE = 1 << 20
MAX_INDEX = 64 << 20  # a 64 KiB-chunk index of a 128 GiB blob
MAX_REF = 1 << 20
JSON = [(b"content-type", b"application/json")]


class RangeNotSatisfiable(DSecError):
    code = "range_not_satisfiable"
    status = 416


class MethodNotAllowed(DSecError):
    code = "method_not_allowed"
    status = 405


@dataclass
class Counters:
    requests: int = 0
    blob_bytes_sent: int = 0
    range_requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class StoreApp:
    """ASGI app over a DirStore. ``tokens`` maps a bearer token to what it may do."""

    def __init__(self, store: DirStore, tokens: dict[str, Access]) -> None:
        if not tokens:
            raise ValueError("the store server needs at least one token")
        self.store = store
        self.tokens = tokens
        self.stats = Counters()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.stats.requests += 1
        try:
            await self._route(scope, receive, send)
        except DSecError as exc:
            await _error(send, exc)
        except Exception:
            log.exception("store request %s %s failed", scope.get("method"), scope.get("path"))
            await _error(send, DSecError("internal error; the store log has the details"))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        if path == "/v1/health":
            await _json(send, 200, {"status": "ok"})
            return
        self._authorize(scope, write=method not in ("GET", "HEAD"))
        if m := BLOB_RE.match(path):
            kind, digest = m.group(1), m.group(2)
            if kind == "blobs":
                await self._blob(method, digest, scope, receive, send)
            else:
                await self._index(method, digest, receive, send)
            return
        if m := REF_RE.match(path):
            await self._ref(method, m.group(1), m.group(2), receive, send)
            return
        if path == "/v1/blobs" and method == "GET":
            await _json(send, 200, await asyncio.to_thread(self.store.blobs))
            return
        if path == "/v1/refs" and method == "GET":
            refs = await asyncio.to_thread(self.store.refs)
            await _json(send, 200, [r.model_dump(mode="json") for r in refs])
            return
        if path == "/v1/stats" and method == "GET":
            await _json(send, 200, self.stats.__dict__)
            return
        raise NotFound(f"no such route: {method} {path}")

    def _authorize(self, scope: Scope, *, write: bool) -> None:
        header = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                header = value
                break
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("missing store token: send 'Authorization: Bearer <token>'")
        access: Access | None = None
        for known, grant in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                access = grant
        if access is None:
            raise Unauthenticated("unknown store token")
        if write and access != "write":
            raise PermissionDenied("this token may only read from the store")

    # -- blobs --

    async def _blob(
        self, method: str, digest: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if method in ("GET", "HEAD"):
            await self._send_blob(method, digest, scope, send)
        elif method == "PUT":
            writer = await asyncio.to_thread(self.store.blob_writer, digest)
            try:
                pending = bytearray()
                while True:
                    msg = await receive()
                    pending += msg.get("body", b"")
                    more = bool(msg.get("more_body"))
                    if len(pending) >= 4 * PIECE or (not more and pending):
                        await asyncio.to_thread(writer.write, bytes(pending))
                        pending.clear()
                    if not more:
                        break
                added = await asyncio.to_thread(writer.commit)
            finally:
                await asyncio.to_thread(writer.abort)
            await _json(send, 201 if added else 200, {"digest": digest, "added": added})
        elif method == "DELETE":
            if not await asyncio.to_thread(self.store.delete_blob, digest):
                raise NotFound(f"blob {digest} is not in the store")
            await _json(send, 200, {"digest": digest, "deleted": True})
        else:
            raise _not_allowed(method)

    async def _send_blob(self, method: str, digest: str, scope: Scope, send: Send) -> None:
        try:
            fd = os.open(self.store.blob_path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in the store") from None
        try:
            size = os.fstat(fd).st_size
            start, end, status = 0, size, 200
            rng = _header(scope, b"range")
            if rng is not None:
                start, end = _parse_range(rng, size)
                status = 206
                self.stats.range_requests += 1
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(end - start).encode()),
                (b"accept-ranges", b"bytes"),
            ]
            if status == 206:
                headers.append((b"content-range", f"bytes {start}-{end - 1}/{size}".encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if method == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            pos = start
            while pos < end:
                n = min(PIECE, end - pos)
                # A page-cache read of <= 1 MiB costs less than a thread hop.
                data = os.pread(fd, n, pos)
                if len(data) != n:
                    raise DSecError(f"blob {digest} shrank while being sent")
                pos += n
                self.stats.blob_bytes_sent += n
                await send({"type": "http.response.body", "body": data, "more_body": pos < end})
            if start == end:
                await send({"type": "http.response.body", "body": b""})
        finally:
            os.close(fd)

    # -- indexes and refs --

    async def _index(self, method: str, digest: str, receive: Receive, send: Send) -> None:
        if method in ("GET", "HEAD"):
            data = await asyncio.to_thread(self.store.get_index, digest)
            if data is None:
                raise NotFound(f"no chunk index for {digest} in the store")
            await _bytes(send, data, head=method == "HEAD")
        elif method == "PUT":
            body = await _read_body(receive, MAX_INDEX, "chunk index")
            if len(body) < HEADER.size:
                raise InvalidArgument("the chunk index is truncated")
            await asyncio.to_thread(self.store.put_index, digest, body)
            await _json(send, 201, {"digest": digest})
        else:
            raise _not_allowed(method)

    async def _ref(
        self, method: str, name: str, version: str, receive: Receive, send: Send
    ) -> None:
        if method == "GET":
            rec = await asyncio.to_thread(self.store.get_ref, name, version)
            if rec is None:
                raise NotFound(f"no layer {name}:{version} in the store")
            await _json(send, 200, rec.model_dump(mode="json"))
        elif method == "PUT":
            body = await _read_body(receive, MAX_REF, "layer reference")
            try:
                rec = LayerRecord.model_validate_json(body)
            except ValidationError as exc:
                raise InvalidArgument(
                    f"invalid layer reference: {exc.errors()[0]['msg']}"
                ) from None
            if (rec.name, rec.version) != (name, version):
                raise InvalidArgument(f"the body names {rec.ref}, the path {name}:{version}")
            if self.store.blob_size(rec.digest) is None:
                raise InvalidArgument(f"push blob {rec.digest} before the reference to it")
            await asyncio.to_thread(self.store.put_ref, rec)
            await _json(send, 201, rec.model_dump(mode="json"))
        elif method == "DELETE":
            if not await asyncio.to_thread(self.store.delete_ref, name, version):
                raise NotFound(f"no layer {name}:{version} in the store")
            await _json(send, 200, {"deleted": f"{name}:{version}"})
        else:
            raise _not_allowed(method)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _parse_range(value: str, size: int) -> tuple[int, int]:
    """One ``bytes=a-b`` / ``a-`` / ``-n`` range -> [start, end) (416 if unsatisfiable)."""
    m = RANGE_RE.match(value.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(f"unsupported Range {value!r}: send one bytes=a-b range")
    first, last = m.group(1), m.group(2)
    if not first:
        n = int(last)
        start, end = max(0, size - n), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise RangeNotSatisfiable(f"range {value!r} is outside the blob ({size} bytes)")
    return start, end


async def _read_body(receive: Receive, limit: int, what: str) -> bytes:
    body = bytearray()
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if len(body) > limit:
            raise LimitExceeded(f"the {what} is larger than {limit} bytes")
        if not msg.get("more_body"):
            return bytes(body)


def _not_allowed(method: str) -> DSecError:
    return MethodNotAllowed(f"method {method} is not allowed here")


async def _json(send: Send, status: int, doc: object) -> None:
    body = json.dumps(doc, default=str).encode()
    await send({"type": "http.response.start", "status": status, "headers": JSON})
    await send({"type": "http.response.body", "body": body})


async def _bytes(send: Send, data: bytes, *, head: bool = False) -> None:
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(len(data)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else data})


async def _error(send: Send, exc: DSecError) -> None:
    headers = list(JSON)
    if isinstance(exc, Unauthenticated):
        headers.append((b"www-authenticate", b"Bearer"))
    body = json.dumps(exc.to_payload(), default=str).encode()
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve(
    store: DirStore,
    tokens: dict[str, Access],
    *,
    host: str,
    port: int,
    ready: Callable[[str], None] | None = None,
    tls: tuple[Path, Path] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn with httptools, on uvloop when installed);
    over HTTPS with ``tls`` = (certificate chain, key), PEM files."""
    import uvicorn

    sock = listen(host, port)  # a taken port is said before the store is opened
    port = bound_port(sock)  # port 0: the one chosen
    try:
        store.open()
    except BaseException:
        sock.close()
        raise
    config = uvicorn.Config(
        StoreApp(store, tokens),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        http="httptools",
        lifespan="off",
        timeout_keep_alive=75,
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )
    server = uvicorn.Server(config)

    async def main() -> None:
        async def announce() -> None:
            while not server.started and not server.should_exit:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            if server.started and ready is not None:
                ready(f"{'https' if tls else 'http'}://{host}:{port}")

        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()
            sock.close()
        if not server.started:
            raise OSError(f"could not listen on {host}:{port}")

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
