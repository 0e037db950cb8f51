"""Batch creation: ``count`` sandboxes of one spec for one RL job, with progress and cancel.

Every sandbox goes through ``SandboxCreator.create`` (authorise, charge the quota, place,
create), so a batch is exactly ``count`` single creates with bounded concurrency; it
adds no second create path that could drift from the first.

Semantics, in the order a caller meets them:

- **In memory, per apiserver.** A batch lives in the memory of the apiserver that runs
  it (its id is only known there); restarting that apiserver ends it, and the sandboxes
  it created stay (they belong to the job: list them by the ``dsec.batch`` label).
- **Tagging.** Sandbox ``i`` gets ``job_id=job`` and the labels ``dsec.batch=<id>``
  and ``dsec.index=<i>``.
- **Concurrency.** At most ``parallelism`` creates of one batch are in flight, and at
  most ``max_in_flight`` across all batches of this apiserver. Creates are CPU-bound
  on the edge (~60 ms CPU each), so the single-node default is a few per core; in
  cluster mode the creator places over many edges, so raise it per batch
  (``parallelism``) or per apiserver (``DSEC_BATCH_PARALLELISM``).
- **Partial failure** is reported per index with the typed error of that create.
- **Stop on quota.** Once a create fails with ``QuotaExceeded`` or ``ClusterFull``,
  every index not yet started fails at once with that same error (details carry
  ``attempted: false``) instead of hammering the quota or a full cluster; creates
  already in flight finish and are reported.
- **Cancel** (``DELETE``, or the client going away) stops launching creates; creates in
  flight finish and are reported; the indexes never started are counted ``cancelled``
  in ``done``. ``stop_created=True`` also stops every sandbox the batch created (a job
  abandoned as a whole); a client disconnect never does: created sandboxes belong to
  the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from dsec.api.batch import (
    BATCH_LABEL,
    INDEX_LABEL,
    MAX_BATCH_PARALLELISM,
    BatchAccepted,
    BatchCreated,
    BatchDone,
    BatchError,
    BatchEvent,
    BatchFailed,
    BatchStateName,
    BatchStatus,
    CreateBatchRequest,
)
from dsec.api.sandbox import SandboxInfo
from dsec.api.spec import RunArgs
from dsec.backends.kinds import require_backend
from dsec.errors import (
    BatchNotFound,
    ClusterFull,
    DSecError,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    QuotaExceeded,
)

if TYPE_CHECKING:  # the apiserver package imports this module
    from dsec.apiserver.creator import SandboxCreator

log = logging.getLogger("dsec.batch")

# Failures that say "no more room": the rest of the batch would fail the same way.
STOP_ERRORS: tuple[type[DSecError], ...] = (QuotaExceeded, ClusterFull)
MAX_LABELS = 64
ADMIN = "admin"


def default_parallelism() -> int:
    """Creates in flight per batch when the request does not say: a few per core of
    this host (the in-process edge's creates are CPU-bound); DSEC_BATCH_PARALLELISM
    overrides it (cluster mode: the creator spreads them over many edges)."""
    env = os.environ.get("DSEC_BATCH_PARALLELISM")
    if env and env.isdigit() and int(env) > 0:
        return min(int(env), MAX_BATCH_PARALLELISM)
    return max(2, 4 * (os.cpu_count() or 1))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


class RunningBatch:
    """One batch: its counters, its event queue and the task that drives it."""

    def __init__(
        self,
        runner: BatchRunner,
        batch_id: str,
        principal: str,
        req: CreateBatchRequest,
        parallelism: int,
    ) -> None:
        self._runner = runner
        self.id = batch_id
        self.principal = principal
        self.job = req.job
        self.count = req.count
        self.timeout = req.timeout
        self.parallelism = parallelism
        self.spec = req.spec
        self.started_at = datetime.now(UTC)
        self._t0 = time.monotonic()
        self._ended: float | None = None
        self.next_index = 0
        self.in_flight = 0
        self.created: dict[int, str] = {}  # index -> sandbox id (ids only: 32,000 specs add up)
        self.failures: dict[int, BatchError] = {}
        self.cancelled = 0
        self.stopped = 0
        self.stop_error: BatchError | None = None
        self.cancel_reason: str | None = None
        self.stop_created = False
        self.done: BatchDone | None = None
        self._queue: asyncio.Queue[BatchEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    # ---- state -----------------------------------------------------------------------

    @property
    def state(self) -> BatchStateName:
        if self.done is not None:
            return "done"
        return "cancelling" if self.cancel_reason is not None else "running"

    def elapsed(self) -> float:
        return (self._ended or time.monotonic()) - self._t0

    def status(self) -> BatchStatus:
        return BatchStatus(
            id=self.id,
            job=self.job,
            principal=self.principal,
            count=self.count,
            parallelism=self.parallelism,
            state=self.state,
            created=len(self.created),
            failed=len(self.failures),
            in_flight=self.in_flight,
            cancelled=self.cancelled,
            stopped=self.stopped,
            pending=max(0, self.count - self.next_index),
            started_at=self.started_at,
            duration=self.elapsed(),
            failures_by_code=dict(Counter(e.code for e in self.failures.values())),
            reason=self.done.reason if self.done is not None else self.cancel_reason,
        )

    def cancel(self, reason: str, *, stop_created: bool = False) -> None:
        """Launch no more creates (idempotent); in-flight ones finish and are reported."""
        if self.done is not None:
            return
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.stop_created = self.stop_created or stop_created

    # ---- events ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[list[BatchEvent]]:
        """The events in order, in chunks of whatever is ready (one consumer: the POST
        that started the batch), ending with ``done``."""
        while True:
            chunk = [await self._queue.get()]
            while not self._queue.empty():
                chunk.append(self._queue.get_nowait())
            yield chunk
            if isinstance(chunk[-1], BatchDone):
                return

    def _emit(self, event: BatchEvent) -> None:
        self._queue.put_nowait(event)

    # ---- driving ---------------------------------------------------------------------

    def start(self) -> None:
        self._emit(
            BatchAccepted(
                batch_id=self.id, count=self.count, job=self.job, parallelism=self.parallelism
            )
        )
        self._task = asyncio.create_task(self._run(), name=f"dsec-batch-{self.id}")

    def _spec_for(self, index: int) -> RunArgs:
        labels = {**self.spec.labels, BATCH_LABEL: self.id, INDEX_LABEL: str(index)}
        return self.spec.model_copy(update={"job_id": self.job, "labels": labels})

    def _fail(self, index: int, error: BatchError) -> None:
        self.failures[index] = error
        self._emit(BatchFailed(index=index, error=error, elapsed=self.elapsed()))

    async def _create(self, index: int) -> None:
        runner = self._runner
        try:
            async with runner.slots:
                info = await runner.creator.create(
                    self.principal, self._spec_for(index), timeout=self.timeout
                )
        except DSecError as exc:
            error = BatchError.of(exc)
            if isinstance(exc, STOP_ERRORS) and self.stop_error is None:
                self.stop_error = error
            self._fail(index, error)
            return
        except Exception as exc:  # a bug must cost one index, not the whole batch
            log.exception("batch %s: create %d failed", self.id, index)
            self._fail(index, BatchError(code="internal", message=f"{type(exc).__name__}: {exc}"))
            return
        self.created[index] = info.id
        if runner.decorate is not None:
            with contextlib.suppress(DSecError):  # the data path is a convenience
                info = await runner.decorate(info)
        self._emit(BatchCreated(index=index, sandbox=info, elapsed=self.elapsed()))

    async def _worker(self) -> None:
        while self.cancel_reason is None and self.next_index < self.count:
            index = self.next_index
            self.next_index += 1
            if self.stop_error is not None:
                self._fail_fast(index, self.stop_error)
                continue
            self.in_flight += 1
            try:
                await self._create(index)
            finally:
                self.in_flight -= 1

    def _fail_fast(self, index: int, error: BatchError) -> None:
        details = {**error.details, "attempted": False}
        self._fail(index, error.model_copy(update={"details": details}))

    async def _run(self) -> None:
        try:
            workers = min(self.parallelism, self.count)
            await asyncio.gather(*(self._worker() for _ in range(workers)))
            if self.stop_error is not None:  # workers may have left before the error
                while self.cancel_reason is None and self.next_index < self.count:
                    self._fail_fast(self.next_index, self.stop_error)
                    self.next_index += 1
            self.cancelled = self.count - self.next_index
            self.next_index = self.count
            if self.stop_created and self.created:
                await self._stop_created()
        finally:
            self._ended = time.monotonic()
            reason = self.cancel_reason
            if reason is None and self.stop_error is not None:
                reason = f"stopped early: {self.stop_error.code}: {self.stop_error.message}"
            self.done = BatchDone(
                batch_id=self.id,
                created=len(self.created),
                failed=len(self.failures),
                cancelled=self.cancelled,
                stopped=self.stopped,
                duration=self.elapsed(),
                reason=reason,
            )
            self._emit(self.done)
            self._runner._finished(self)

    async def _stop_created(self) -> None:
        ids = list(self.created.values())
        sem = asyncio.Semaphore(self.parallelism)

        async def stop(sandbox_id: str) -> None:
            async with sem:
                try:
                    await self._runner.creator.stop(self.principal, sandbox_id)
                    self.stopped += 1
                except DSecError as exc:
                    log.warning("batch %s: stopping %s: %s", self.id, sandbox_id, exc)

        await asyncio.gather(*(stop(i) for i in ids))

    async def wait(self) -> BatchDone:
        if self._task is not None:
            await asyncio.shield(self._task)
        assert self.done is not None
        return self.done


class BatchRunner:
    """The batches of one apiserver (in memory; see the module docstring).

    ``decorate`` adds what the sandbox routes add to a create answer (the data path),
    so a created event is as usable as a create response.
    """

    def __init__(
        self,
        creator: SandboxCreator,
        *,
        parallelism: int | None = None,
        max_batches: int | None = None,
        max_in_flight: int | None = None,
        keep_done_seconds: float = 600.0,
        keep_done_max: int = 256,
        decorate: Callable[[SandboxInfo], Awaitable[SandboxInfo]] | None = None,
    ) -> None:
        self.creator = creator
        self.default_parallelism = parallelism or default_parallelism()
        self.max_batches = max_batches or _env_int("DSEC_MAX_BATCHES", 16)
        self.max_in_flight = max_in_flight or _env_int(
            "DSEC_BATCH_MAX_IN_FLIGHT", max(self.default_parallelism * 2, 64)
        )
        self.keep_done_seconds = keep_done_seconds
        self.keep_done_max = keep_done_max
        self.decorate = decorate
        self._slots: asyncio.Semaphore | None = None
        self._batches: dict[str, RunningBatch] = {}
        self._done_order: list[str] = []

    @property
    def slots(self) -> asyncio.Semaphore:
        """Creates in flight across all batches (made lazily: it binds to the loop)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        return self._slots

    def running(self) -> list[RunningBatch]:
        return [b for b in self._batches.values() if b.done is None]

    def start(self, principal: str, req: CreateBatchRequest) -> RunningBatch:
        """Admit and start a batch; raises a typed 422 when it cannot be run at all (501
        for a backend kind the platform has no backend for)."""
        require_backend(req.spec)
        running = self.running()
        if len(running) >= self.max_batches:
            raise LimitExceeded(
                f"this apiserver already runs {len(running)} batches (limit "
                f"{self.max_batches}); wait for one to finish or cancel one",
                running=len(running),
                limit=self.max_batches,
            )
        if req.spec.job_id is not None and req.spec.job_id != req.job:
            raise InvalidArgument(
                f"spec.job_id {req.spec.job_id!r} differs from the batch's job {req.job!r}; "
                "leave spec.job_id unset (the batch sets it)"
            )
        extra = {BATCH_LABEL, INDEX_LABEL} - set(req.spec.labels)
        if len(req.spec.labels) + len(extra) > MAX_LABELS:
            raise InvalidArgument(
                f"spec.labels: a batch adds the labels {BATCH_LABEL} and {INDEX_LABEL}; "
                f"at most {MAX_LABELS - len(extra)} labels of your own"
            )
        parallelism = req.parallelism or self.default_parallelism
        batch_id = "b-" + secrets.token_hex(8)
        batch = RunningBatch(self, batch_id, principal, req, parallelism)
        self._batches[batch_id] = batch
        batch.start()
        log.info(
            "batch %s: %d sandboxes of %s for job %s by %s, parallelism %d",
            batch_id,
            req.count,
            req.spec.image_ref,
            req.job,
            principal,
            parallelism,
        )
        return batch

    def get(self, batch_id: str, principal: str) -> RunningBatch:
        """The batch, if ``principal`` started it (or is the admin)."""
        batch = self._batches.get(batch_id)
        if batch is None:
            raise BatchNotFound(
                f"no batch {batch_id[:80]!r} on this apiserver (batches live in the memory "
                "of the apiserver that runs them, and are forgotten a while after they end)"
            )
        if principal != batch.principal and principal != ADMIN:
            raise PermissionDenied(f"batch {batch_id} belongs to another principal")
        return batch

    def cancel(self, batch_id: str, principal: str, *, stop_created: bool = False) -> BatchStatus:
        batch = self.get(batch_id, principal)
        batch.cancel(f"cancelled by {principal}", stop_created=stop_created)
        return batch.status()

    def _finished(self, batch: RunningBatch) -> None:
        """Keep a finished batch for a while so GET can still answer, then forget it."""
        self._done_order.append(batch.id)
        while len(self._done_order) > self.keep_done_max:
            self._batches.pop(self._done_order.pop(0), None)
        asyncio.get_running_loop().call_later(self.keep_done_seconds, self._forget, batch.id)

    def _forget(self, batch_id: str) -> None:
        if batch_id in self._done_order:
            self._done_order.remove(batch_id)
            self._batches.pop(batch_id, None)

    async def close(self) -> None:
        """Cancel every running batch and wait for its in-flight creates."""
        batches = self.running()
        for batch in batches:
            batch.cancel("apiserver shutting down")
        for batch in batches:
            with contextlib.suppress(Exception):
                await batch.wait()
