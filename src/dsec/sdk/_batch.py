"""Batch creation in the SDK: ``create_batch`` on both clients, the ``Batch`` handles.

    batch = await client.create_batch(args, count=2000, job="rl-job-42")
    async for event in batch:            # accepted, created/failed per index, done
        if event.event == "failed":
            print(event.index, event.error.code)
    print(len(batch.sandboxes), batch.failures, batch.done)

The server streams NDJSON; a reader task turns it into typed events as they arrive, so
interrupting a wait (Ctrl-C, a timeout) never loses the stream: call ``cancel()`` and
keep iterating to see what the cancel left. Closing the batch (``aclose``, leaving
``async with``) closes the stream, which cancels on the server whatever has not started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from dsec.api.batch import (
    BatchAccepted,
    BatchCreated,
    BatchDone,
    BatchError,
    BatchEvent,
    BatchFailed,
    BatchStatus,
    CreateBatchRequest,
    batch_event_adapter,
)
from dsec.api.sandbox import SandboxInfo
from dsec.api.spec import RunArgs
from dsec.errors import BatchNotFound, DSecError, PlatformUnavailable
from dsec.sdk import _http
from dsec.sdk._protocol import _JSON_HEADERS, Call, _model, invalid, wait_timeout

if TYPE_CHECKING:
    from dsec.sdk._portal import Portal
    from dsec.sdk.client import DSecClient, Sandbox
    from dsec.sdk.sync import DSecSyncClient, SyncSandbox

H = TypeVar("H")

# ---- protocol --------------------------------------------------------------------------


def create_batch_body(
    args: RunArgs, count: int, job: str, timeout: float, parallelism: int | None
) -> bytes:
    try:
        body = CreateBatchRequest(
            spec=args, count=count, job=job, timeout=timeout, parallelism=parallelism
        )
    except ValidationError as exc:
        raise invalid(exc) from None
    return body.model_dump_json(exclude_none=True).encode()


def batch_path(batch_id: str) -> str:
    if not batch_id or "/" in batch_id or len(batch_id) > 64:
        raise BatchNotFound(f"no batch {batch_id[:80]!r}: batch ids look like 'b-0123456789abcdef'")
    return "/v1/batches/" + quote(batch_id, safe="")


def get_batch(batch_id: str) -> Call[BatchStatus]:
    return Call("GET", batch_path(batch_id), _model(BatchStatus))


def cancel_batch(batch_id: str, stop_created: bool) -> Call[BatchStatus]:
    params = [("stop_created", "true")] if stop_created else None
    return Call("DELETE", batch_path(batch_id), _model(BatchStatus), params=params)


# ---- the async handle ------------------------------------------------------------------

_END = object()


class Batch(Generic[H]):
    """A running batch: an async iterator of typed events plus what they collected.

    ``sandboxes`` (handles, by index order of arrival), ``failures`` (index -> typed
    error as data; ``.exception()`` gives the error), ``done`` (the final counts) are
    up to date with every event received, whether or not you iterate.
    """

    def __init__(
        self,
        client: DSecClient,
        resp: httpx.Response,
        wrap: Callable[[SandboxInfo], H],
    ) -> None:
        self._client = client
        self._resp = resp
        self._wrap = wrap
        self.id: str | None = None
        self.accepted: BatchAccepted | None = None
        self.created: dict[int, SandboxInfo] = {}
        self.failures: dict[int, BatchError] = {}
        self.done: BatchDone | None = None
        self._handles: dict[int, H] = {}
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._first = asyncio.get_running_loop().create_future()
        self._finished = False
        self._reader = asyncio.create_task(self._read(), name="dsec-batch-reader")

    def __repr__(self) -> str:
        return (
            f"Batch(id={self.id!r}, created={len(self.created)}, failed={len(self.failures)}, "
            f"done={self.done is not None})"
        )

    @property
    def sandboxes(self) -> list[H]:
        """Handles of the sandboxes created so far, in the order they were created."""
        for index, info in self.created.items():
            if index not in self._handles:
                self._handles[index] = self._wrap(info)
        return [self._handles[i] for i in self.created]

    def sandbox(self, index: int) -> H:
        """The handle of the sandbox created for ``index`` (KeyError if it was not)."""
        if index not in self._handles:
            self._handles[index] = self._wrap(self.created[index])
        return self._handles[index]

    # ---- reading ---------------------------------------------------------------------

    def _record(self, event: BatchEvent) -> None:
        if isinstance(event, BatchAccepted):
            self.accepted, self.id = event, event.batch_id
        elif isinstance(event, BatchCreated):
            self.created[event.index] = event.sandbox
        elif isinstance(event, BatchFailed):
            self.failures[event.index] = event.error
        else:
            self.done = event

    async def _read(self) -> None:
        error: DSecError | None = None
        try:
            async for line in self._resp.aiter_lines():
                if not line.strip():
                    continue
                try:
                    event = batch_event_adapter.validate_json(line)
                except ValidationError as exc:
                    raise DSecError(
                        f"unexpected batch event (is the SDK too old?): {exc}"
                    ) from None
                self._record(event)
                if not self._first.done():
                    self._first.set_result(None)
                self._queue.put_nowait(event)
                if isinstance(event, BatchDone):
                    return
            error = PlatformUnavailable(
                f"the batch stream from {self._client.url} ended before 'done'",
                url=self._client.url,
            )
        except httpx.HTTPError as exc:
            error = _http.transport_error(exc, self._client.url)
        except DSecError as exc:
            error = exc
        finally:
            if error is not None:
                self._queue.put_nowait(error)
                if not self._first.done():
                    self._first.set_exception(error)
            self._queue.put_nowait(_END)
            await self._resp.aclose()

    async def _accepted(self) -> None:
        await asyncio.shield(self._first)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> BatchEvent:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, DSecError):
            self._finished = True
            raise item
        event: BatchEvent = item
        return event

    async def wait(self) -> BatchDone:
        """Read the remaining events; the final counts."""
        async for _ in self:
            pass
        if self.done is None:
            raise PlatformUnavailable(f"the batch stream from {self._client.url} ended early")
        return self.done

    # ---- control ---------------------------------------------------------------------

    def _id(self) -> str:
        if self.id is None:
            raise DSecError("the batch has no id yet (its stream has not started)")
        return self.id

    async def cancel(self, *, stop_created: bool = False) -> BatchStatus:
        """Start no more creates; keep iterating to see the in-flight ones and ``done``.

        ``stop_created`` also stops the sandboxes the batch created."""
        return await self._client._send(cancel_batch(self._id(), stop_created))

    async def status(self) -> BatchStatus:
        return await self._client._send(get_batch(self._id()))

    async def aclose(self) -> None:
        """Close the stream: the server cancels what has not started (created ones stay)."""
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await self._resp.aclose()
        self._finished = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def open_batch(
    client: DSecClient,
    args: RunArgs,
    *,
    count: int,
    job: str,
    timeout: float,
    parallelism: int | None,
    wrap: Callable[[SandboxInfo], H],
) -> Batch[H]:
    """POST the batch and wait for ``accepted`` (a refused batch raises its typed error)."""
    content = create_batch_body(args, count, job, timeout, parallelism)
    try:
        resp = await client._open_stream(
            "POST",
            "/v1/batches",
            content=content,
            headers=_JSON_HEADERS,
            timeout=wait_timeout(None),
        )
    except httpx.HTTPError as exc:
        raise _http.transport_error(exc, client.url) from exc
    if resp.status_code >= 400:
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        _http.raise_for_error(resp)
    batch = Batch(client, resp, wrap)
    try:
        await batch._accepted()
    except BaseException:
        await batch.aclose()
        raise
    return batch


class BatchMixin:
    async def create_batch(
        self,
        args: RunArgs,
        *,
        count: int,
        job: str,
        parallelism: int | None = None,
        timeout: float = 120,
    ) -> Batch[Sandbox]:
        """Create ``count`` sandboxes of ``args`` for ``job``; returns once the batch is
        accepted. Iterate it for typed events (``accepted``, ``created``/``failed`` per
        index, ``done``). Each sandbox gets ``job_id=job`` and labels ``dsec.batch``,
        ``dsec.index``. ``parallelism``: creates in flight (default: the server's).
        ``timeout`` bounds each create."""
        from dsec.sdk.client import DSecClient, Sandbox

        assert isinstance(self, DSecClient)
        client = self

        def wrap(info: SandboxInfo) -> Sandbox:
            return Sandbox(client, info)

        return await open_batch(
            client,
            args,
            count=count,
            job=job,
            timeout=timeout,
            parallelism=parallelism,
            wrap=wrap,
        )

    async def get_batch(self, batch_id: str) -> BatchStatus:
        """Progress of a batch run by the apiserver this client talks to."""
        from dsec.sdk.client import DSecClient

        assert isinstance(self, DSecClient)
        return await self._send(get_batch(batch_id))

    async def cancel_batch(self, batch_id: str, *, stop_created: bool = False) -> BatchStatus:
        from dsec.sdk.client import DSecClient

        assert isinstance(self, DSecClient)
        return await self._send(cancel_batch(batch_id, stop_created))


# ---- the sync twin ---------------------------------------------------------------------


class SyncBatch:
    """Blocking twin of ``Batch``: an iterator of typed events (driven in the portal).

    Ctrl-C while waiting for an event leaves the batch intact: call ``cancel()`` and keep
    iterating to collect the in-flight creates and ``done``.
    """

    def __init__(self, client: DSecSyncClient, portal: Portal, batch: Batch[SandboxInfo]):
        self._client = client
        self._portal = portal
        self._batch = batch
        self._handles: dict[int, SyncSandbox] = {}

    def __repr__(self) -> str:
        return repr(self._batch).replace("Batch(", "SyncBatch(", 1)

    @property
    def id(self) -> str | None:
        return self._batch.id

    @property
    def created(self) -> dict[int, SandboxInfo]:
        return self._batch.created

    @property
    def failures(self) -> dict[int, BatchError]:
        return self._batch.failures

    @property
    def done(self) -> BatchDone | None:
        return self._batch.done

    @property
    def sandboxes(self) -> list[SyncSandbox]:
        from dsec.sdk.sync import SyncSandbox

        for index, info in self._batch.created.items():
            if index not in self._handles:
                self._handles[index] = SyncSandbox(self._client, info)
        return [self._handles[i] for i in self._batch.created]

    def __iter__(self) -> Iterator[BatchEvent]:
        return self

    def __next__(self) -> BatchEvent:
        try:
            return self._portal.call(self._batch.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def wait(self) -> BatchDone:
        return self._portal.call(self._batch.wait())

    def cancel(self, *, stop_created: bool = False) -> BatchStatus:
        return self._portal.call(self._batch.cancel(stop_created=stop_created))

    def status(self) -> BatchStatus:
        return self._portal.call(self._batch.status())

    def close(self) -> None:
        self._portal.call(self._batch.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class SyncBatchMixin:
    def create_batch(
        self,
        args: RunArgs,
        *,
        count: int,
        job: str,
        parallelism: int | None = None,
        timeout: float = 120,
    ) -> SyncBatch:
        """Blocking ``create_batch``: returns once accepted; iterate it for events."""
        from dsec.sdk.sync import DSecSyncClient

        assert isinstance(self, DSecSyncClient)
        portal = self._portal()
        aclient = self._async_client()

        def keep(info: SandboxInfo) -> SandboxInfo:
            return info

        batch = portal.call(
            open_batch(
                aclient,
                args,
                count=count,
                job=job,
                timeout=timeout,
                parallelism=parallelism,
                wrap=keep,
            )
        )
        return SyncBatch(self, portal, batch)

    def get_batch(self, batch_id: str) -> BatchStatus:
        from dsec.sdk.sync import DSecSyncClient

        assert isinstance(self, DSecSyncClient)
        return self._send(get_batch(batch_id))

    def cancel_batch(self, batch_id: str, *, stop_created: bool = False) -> BatchStatus:
        from dsec.sdk.sync import DSecSyncClient

        assert isinstance(self, DSecSyncClient)
        return self._send(cancel_batch(batch_id, stop_created))
