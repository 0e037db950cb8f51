"""The trajectory log on the wire (requests, answers, listings).

A step is one state-changing request on a sandbox: a command (``/bin/sh -c`` string or
argv, optionally in a shell session) or a file write. The log matches a step sent again
by its content hash (dsec.rl.trajectory), never by its step number alone.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dsec.api.base import Reply, Strict
from dsec.api.exec import CommandArgs
from dsec.api.fields import SANDBOX_ID_RE, TRAJECTORY_NAME_RE

#: Steps per batch request (the SDK splits longer runs): bounds one request's work.
MAX_BATCH = 5000


#: ``model_call``: a call of a hosted rollout's scaffold through the model gateway
#: (dsec.rollouts.gateway), logged by the platform, never sent as a step by a caller.
StepOp = Literal["exec", "session", "write_file", "model_call"]


StepStatus = Literal["pending", "ok", "error"]


def check_name(value: str, what: str) -> str:
    if not TRAJECTORY_NAME_RE.match(value):
        from dsec.errors import InvalidArgument

        raise InvalidArgument(
            f"{what} must be 1-128 characters of letters, digits and ._:@- "
            f"(starting with a letter or digit), got {value[:200]!r}"
        )
    return value


class FileWrite(Strict):
    """Create or replace a file with ``content_b64`` (base64 of the bytes)."""

    path: str = Field(min_length=2, max_length=4096, pattern=r"^/[^\x00]*$")
    content_b64: str = ""
    mode: int = Field(0o644, ge=0, le=0o7777)

    @field_validator("content_b64")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except binascii.Error:
            raise ValueError("content_b64 is not valid base64") from None
        return v

    def data(self) -> bytes:
        return base64.b64decode(self.content_b64)


class StepRequest(Strict):
    """One step: exactly one of ``command`` (with ``command.session`` for session
    input) or ``file``."""

    step: int = Field(ge=0, le=1 << 40)
    sandbox_id: str = Field(pattern=SANDBOX_ID_RE.pattern)
    command: CommandArgs | None = None
    file: FileWrite | None = None

    @model_validator(mode="after")
    def _one(self) -> StepRequest:
        if (self.command is None) == (self.file is None):
            raise ValueError("a step has exactly one of 'command' or 'file'")
        if self.command is not None and self.command.keep_stdin:
            raise ValueError("a trajectory step runs to completion: keep_stdin is not allowed")
        return self

    @property
    def op(self) -> StepOp:
        if self.file is not None:
            return "write_file"
        assert self.command is not None
        return "session" if self.command.session is not None else "exec"


class StepBatch(Strict):
    """Consecutive steps of one rollout, handled in order as if sent one by one."""

    steps: list[StepRequest] = Field(min_length=1, max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _consecutive(self) -> StepBatch:
        first = self.steps[0].step
        for i, s in enumerate(self.steps):
            if s.step != first + i:
                raise ValueError(
                    f"steps of a batch must be consecutive: expected {first + i}, got {s.step}"
                )
        return self


class StepAnswer(Reply):
    """What a step got: ``result`` (an ExecResult for commands, ``{"path","size"}`` for
    a file write) or ``error`` (a typed error payload); ``replayed`` when it came from
    the log without touching the sandbox."""

    step: int
    replayed: bool
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class StepRecord(Reply):
    """One logged step (query and export)."""

    job_id: str
    rollout_id: str
    step: int
    sandbox_id: str
    op: StepOp
    hash: str
    status: StepStatus
    request: dict[str, Any]
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    created_at: datetime
    finished_at: datetime | None = None
    replays: int = Field(0, description="how often the log answered this step since")


class TrajectoryInfo(Reply):
    job_id: str
    rollout_id: str
    steps: int
    sandboxes: list[str]
    created_at: datetime
    updated_at: datetime
    discarded: int = Field(0, description="steps discarded after divergences, in total")
