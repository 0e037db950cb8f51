"""/v1/batches: create many sandboxes of one spec for a job, streamed as NDJSON.

The POST answers once the batch is admitted (bad requests are typed 4xx before any
byte of the stream) and then streams one event per line. The batch runs in its own
task, so DELETE and GET reach it from any connection; the stream ending early (the
client went away) cancels what has not started (dsec.control.batch).
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query
from starlette.responses import Response, StreamingResponse

from dsec.api.batch import BatchStatus, CreateBatchRequest
from dsec.api.sandbox import DataPathInfo, SandboxInfo
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.control.batch import BatchRunner, RunningBatch

NDJSON = "application/x-ndjson"


async def _stream(batch: RunningBatch) -> AsyncIterator[bytes]:
    try:
        async for chunk in batch.events():
            yield b"".join(event.model_dump_json().encode() + b"\n" for event in chunk)
    finally:
        if batch.done is None:  # the client is gone: start nothing more for it
            batch.cancel("client disconnected")


def batch_runner(
    creator: SandboxCreator,
    data_path: Callable[[str], Awaitable[DataPathInfo]] | None = None,
    *,
    parallelism: int | None = None,
    max_in_flight: int | None = None,
) -> BatchRunner:
    """The apiserver's runner; created events carry the data path like a create answer.
    ``parallelism`` and ``max_in_flight``: None keeps BatchRunner's defaults."""
    if data_path is None:
        return BatchRunner(creator, parallelism=parallelism, max_in_flight=max_in_flight)
    path = data_path

    async def with_data_path(info: SandboxInfo) -> SandboxInfo:
        info.data_path = await path(info.id)
        return info

    return BatchRunner(
        creator, parallelism=parallelism, max_in_flight=max_in_flight, decorate=with_data_path
    )


async def cancel_batches_on_exit(server: Any, app: FastAPI) -> None:
    """uvicorn waits for open responses before it exits, and a batch stream is one that
    could last for thousands of creates: once ``server.should_exit`` is set, cancel the
    running batches so their streams end (creates in flight finish and are reported)."""
    runner = getattr(app.state, "batches", None)
    while True:  # uvicorn offers no shutdown hook with lifespan off
        if server.should_exit:
            break
        await asyncio.sleep(0.1)
    if isinstance(runner, BatchRunner):
        await runner.close()


def batch_router(runner: BatchRunner, auth: Authenticator) -> APIRouter:
    Principal = Annotated[str, Depends(auth)]
    router = APIRouter(
        prefix="/v1/batches",
        tags=["batches"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.post(
        "",
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {NDJSON: {}},
                "description": "one event per line: accepted, then created/failed per "
                "index, then done",
            }
        },
        summary="Create a batch of sandboxes",
    )
    async def create_batch(body: CreateBatchRequest, principal: Principal) -> Response:
        """Create `count` sandboxes of `spec` for `job`, streaming progress as NDJSON.

        Each sandbox gets `job_id=job` and labels `dsec.batch=<id>`, `dsec.index=<i>`.
        A `QuotaExceeded` or `ClusterFull` fails every index not yet started with that
        error at once. Closing the stream cancels the indexes not started (created
        sandboxes stay). The batch lives in this apiserver's memory.
        """
        batch = runner.start(principal, body)
        return StreamingResponse(
            _stream(batch),
            media_type=NDJSON,
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @router.get("/{batch_id}", response_model=BatchStatus, summary="Progress of a batch")
    async def get_batch(batch_id: str, principal: Principal) -> Response:
        return model_response(runner.get(batch_id, principal).status())

    @router.delete("/{batch_id}", response_model=BatchStatus, summary="Cancel a batch")
    async def cancel_batch(
        batch_id: str,
        principal: Principal,
        stop_created: Annotated[
            bool, Query(description="also stop the sandboxes the batch created")
        ] = False,
    ) -> Response:
        """Start no more creates; those in flight finish and are reported, the rest are
        counted `cancelled` in `done`. Idempotent; answers at once (state `cancelling`)."""
        return model_response(runner.cancel(batch_id, principal, stop_created=stop_created))

    return router
