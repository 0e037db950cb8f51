"""File bodies of the control routes, streamed: memory per request is one chunk.

``GET``/``PUT /v1/sandboxes/{id}/files`` used to hold the whole file in the apiserver
(a 128 MiB upload got a memory-limited platform OOM-killed). With a data plane they
pass chunks between the socket and the sandbox's agent as they come, with the
backpressure of both ends; without one (an edge that has no data plane) the buffered
path stays, capped at ``ApiLimits.max_file_bytes``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from dsec.apiserver.limits import ApiLimits, set_body_limit

OCTET = "application/octet-stream"


class FileStreams(Protocol):
    """What the streamed routes need of the data plane (dsec.edge.dataplane.DataPlane)."""

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]: ...

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int
    ) -> int: ...


async def nonempty(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The request's body chunks without the empty ones ASGI servers send."""
    async for chunk in chunks:
        if chunk:
            yield chunk


async def read_response(streams: FileStreams, sandbox_id: str, path: str) -> Response:
    """The file as a streamed response; a missing file is a typed error before any byte."""
    return StreamingResponse(await streams.read_stream(sandbox_id, path), media_type=OCTET)


async def write_body(
    streams: FileStreams,
    request: Request,
    limits: ApiLimits,
    sandbox_id: str,
    path: str,
    mode: int,
) -> None:
    """The request body into the file, chunk by chunk (413 past ``max_stream_bytes``)."""
    set_body_limit(request, limits.max_stream_bytes, "file")
    await streams.write_stream(sandbox_id, path, nonempty(request.stream()), mode=mode)
