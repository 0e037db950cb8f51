"""Following the audit log over ``GET /v1/events/stream`` (server-sent events).

The stream is resumable: every frame's ``id`` is the record's ``seq`` (on a cluster's
apiserver, a cursor over every edge, ``e1:120,e2:45``: the follower never reads it, it
only sends it back), and a dropped connection is opened again with ``Last-Event-ID``
set to the last one received, so a follower sees every record once, in order (on a
cluster, each edge's own order), across reconnects (and across an edge restart: the
log is durable). The parser is the SSE line protocol (``field: value`` lines, a blank
line ends a frame, ``:`` lines are comments); each ``data`` is one record's JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING

import httpx

from dsec.api.events import AuditKind, AuditRecord
from dsec.errors import DSecError
from dsec.sdk import _http
from dsec.sdk._security import _params

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient

RECONNECTS = 5  # consecutive failed connects before the follower gives up (typed error)
BACKOFF = 0.5


async def follow(
    client: DSecClient,
    *,
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[AuditKind | str] | None,
    since_seq: int,
) -> AsyncGenerator[AuditRecord, None]:
    params = httpx.QueryParams(
        [p for p in _params(job, sandbox, trajectory, kinds, since_seq, 1) if p[0] != "limit"]
    )
    last: str | None = None
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream"}
        if last is not None:
            headers["Last-Event-ID"] = last
        try:
            resp = await client._open_stream(
                "GET",
                "/v1/events/stream",
                params=params,
                headers=headers,
                timeout=httpx.Timeout(None),
            )
        except httpx.HTTPError as exc:
            failures += 1
            if failures > RECONNECTS:
                raise _http.transport_error(exc, client.url) from exc
            await asyncio.sleep(BACKOFF * failures)
            continue
        try:
            if resp.status_code >= 400:
                await resp.aread()
                _http.raise_for_error(resp)
            failures = 0
            current: dict[str, str] = {}
            async for line in resp.aiter_lines():
                if line:
                    if not line.startswith(":"):
                        name, _, value = line.partition(":")
                        current[name] = value.removeprefix(" ")
                    continue
                data = current.pop("data", None)
                event_id = current.get("id")
                current = {}
                if data is None:
                    continue
                try:
                    record = AuditRecord.model_validate_json(data)
                except ValueError as exc:
                    raise DSecError(f"unexpected audit stream frame: {exc}") from None
                last = event_id if event_id else str(record.seq)
                yield record
        except httpx.HTTPError:
            pass  # dropped: reconnect from the last record seen
        finally:
            await resp.aclose()
        await asyncio.sleep(BACKOFF)
