"""Batch creation on the wire: the request and the NDJSON events of /v1/batches.

One RL job asks for thousands of sandboxes of one spec at once; the answer is a stream
of events, one JSON object per line, each tagged by ``event``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from dsec.api.base import Reply, Strict
from dsec.api.fields import TRAJECTORY_NAME_RE
from dsec.api.sandbox import SandboxInfo
from dsec.api.spec import RunArgs
from dsec.errors import DSecError, error_class_for

MAX_BATCH_COUNT = 32_000


MAX_BATCH_PARALLELISM = 1024


# Labels every sandbox of a batch carries, so a job's sandboxes can be listed by batch.
BATCH_LABEL = "dsec.batch"


INDEX_LABEL = "dsec.index"


class CreateBatchRequest(Strict):
    """``count`` sandboxes of ``spec`` for ``job`` (the spec's job_id is set to it)."""

    spec: RunArgs
    count: int = Field(..., ge=1, le=MAX_BATCH_COUNT, description="sandboxes to create")
    job: str = Field(
        ...,
        pattern=TRAJECTORY_NAME_RE.pattern,
        description="RL job the sandboxes serve; set as every sandbox's job_id",
    )
    timeout: float = Field(120, gt=0, le=3600, description="seconds per sandbox create")
    parallelism: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH_PARALLELISM,
        description="creates in flight at once; None: the apiserver's default for its edges",
    )


class BatchError(Reply):
    """A typed error as data (the ``error`` of the error envelope)."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, exc: DSecError) -> BatchError:
        return cls(code=exc.code, message=exc.message, details=exc.details)

    def exception(self) -> DSecError:
        """The typed error the SDK would raise for this code."""
        exc = error_class_for(self.code)(self.message)
        exc.details = dict(self.details)
        return exc


class BatchAccepted(Reply):
    event: Literal["accepted"] = "accepted"
    batch_id: str
    count: int
    job: str
    parallelism: int


class BatchCreated(Reply):
    event: Literal["created"] = "created"
    index: int
    sandbox: SandboxInfo
    elapsed: float = Field(..., description="seconds from the batch's start to this sandbox")


class BatchFailed(Reply):
    event: Literal["failed"] = "failed"
    index: int
    error: BatchError
    elapsed: float = 0.0


class BatchDone(Reply):
    event: Literal["done"] = "done"
    batch_id: str
    created: int
    failed: int
    cancelled: int = Field(..., description="indexes never started because of a cancel")
    stopped: int = Field(0, description="created sandboxes stopped by cancel(stop_created)")
    duration: float
    reason: str | None = Field(None, description="why the batch ended early, if it did")


BatchEvent = Annotated[
    BatchAccepted | BatchCreated | BatchFailed | BatchDone, Field(discriminator="event")
]


batch_event_adapter: TypeAdapter[BatchEvent] = TypeAdapter(BatchEvent)


BatchStateName = Literal["running", "cancelling", "done"]


class BatchStatus(Reply):
    """Progress of a batch (GET /v1/batches/{id})."""

    id: str
    job: str
    principal: str
    count: int
    parallelism: int
    state: BatchStateName
    created: int
    failed: int
    in_flight: int
    cancelled: int
    stopped: int = 0
    pending: int = Field(..., description="indexes not started yet")
    started_at: datetime
    duration: float = Field(..., description="seconds so far, or in total once done")
    failures_by_code: dict[str, int] = Field(default_factory=dict)
    reason: str | None = None
