"""Rollouts hosted on the platform (DSEC.md §6.2, §6.3) on the wire.

A rollout is an agent sandbox running a scaffold (the caller's command) plus a worker on
the edge that owns its state: the scaffold reaches the model only through the edge's
model gateway, so a trainer that is preempted (its model endpoint down) costs the
rollout a wait, never its progress. The trainer points a job at wherever it came back
(``set_model_endpoint``), collects finished rollouts and acknowledges them.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.fields import TRAJECTORY_NAME_RE, check_env
from dsec.api.fncall import (
    MAX_TESTS,
    Comparator,
    DSecFnCallRunArgs,
    JudgeResult,
    JudgeTest,
)
from dsec.api.spec import RunArgs
from dsec.api.trajectory import StepRecord
from dsec.api.verify import VerifyRequest, VerifyResult

#: Files one rollout may place in its sandbox before the scaffold starts.
MAX_FILES = 256
MAX_FILE_CHARS = 4 << 20


class RolloutState(StrEnum):
    STARTING = "starting"  # sandbox, files, scaffold being set up
    RUNNING = "running"
    WAITING_FOR_MODEL = "waiting_for_model"  # a model call is held: the endpoint is down
    PAUSED = "paused"  # held long enough: the agent sandbox is frozen, memory reclaimed
    REWARDING = "rewarding"  # the scaffold ended; the reward step runs
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RolloutState.FINISHED, RolloutState.FAILED, RolloutState.CANCELLED})


class ModelEndpoint(Strict):
    """An OpenAI-compatible server (the trainer's inference engine). ``api_key`` stays
    on the edge: the agent sandbox only ever sees its rollout's gateway token."""

    base_url: str = Field(
        ..., max_length=2048, description="e.g. http://10.0.0.5:8000/v1 (paths are appended)"
    )
    api_key: str | None = Field(None, max_length=4096, repr=False)
    model: str | None = Field(
        None, max_length=256, description="forced into every request's 'model' field"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")) or any(c.isspace() for c in v):
            raise ValueError(f"base_url must be an http(s) URL, got {v[:200]!r}")
        return v.rstrip("/")

    def public(self) -> ModelEndpointInfo:
        return ModelEndpointInfo(base_url=self.base_url, model=self.model)


class ModelEndpointInfo(Reply):
    """A model endpoint as it is shown back (never the key)."""

    base_url: str
    model: str | None = None


#: The agent's answer a FnCall judge reads (a file is data, never run on the edge).
MAX_JUDGED_BYTES = 1 << 20


class FnCallJudge(Strict):
    """A FnCall judge as a rollout's reward: the file ``code_path`` of the agent sandbox
    (the agent's program, read as data once the scaffold ended) runs against ``tests`` in
    a FnCall sandbox; reward = tests passed / tests."""

    code_path: str = Field(..., min_length=2, max_length=4096, pattern=r"^/[^\x00]*$")
    args: DSecFnCallRunArgs = Field(default_factory=lambda: DSecFnCallRunArgs())
    tests: list[JudgeTest] = Field(min_length=1, max_length=MAX_TESTS)
    comparator: Comparator = "whitespace"
    float_tolerance: float = Field(1e-6, ge=0)


class RolloutSpec(Strict):
    """What one rollout runs. ``sandbox`` is the agent sandbox (any run args; its
    ``job_id``/``trajectory_id`` are set from the rollout, and its network gets the
    model gateway added to whatever rules it has)."""

    job_id: str = Field(..., pattern=TRAJECTORY_NAME_RE.pattern)
    rollout_id: str | None = Field(None, pattern=TRAJECTORY_NAME_RE.pattern)
    sandbox: RunArgs
    files: dict[str, str] = Field(default_factory=dict, description="path -> text content")
    scaffold: str = Field(
        ..., min_length=1, max_length=65536, description="shell command run in the sandbox"
    )
    model: ModelEndpoint | None = Field(
        None, description="the job's endpoint if the job has none yet (set_model_endpoint wins)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="scaffold environment")
    workdir: str | None = None
    max_steps: int | None = Field(
        None, ge=1, le=100_000, description="model calls allowed (then 429 to the scaffold)"
    )
    timeout: float = Field(3600.0, gt=0, le=7 * 86400, description="whole rollout, seconds")
    reward: VerifyRequest | FnCallJudge | None = Field(
        None,
        description="run when the scaffold ends: a verify step (passed -> 1.0) or a FnCall "
        "judge of a file the agent wrote (tests passed / tests)",
    )
    pause_after: float = Field(
        10.0, ge=0, le=86400, description="seconds a model call is held before a pause"
    )

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_FILES:
            raise ValueError(f"at most {MAX_FILES} files")
        for path, content in v.items():
            if not path.startswith("/") or "\x00" in path or len(path) > 4096:
                raise ValueError(f"file path must be absolute, got {path[:200]!r}")
            if len(content) > MAX_FILE_CHARS:
                raise ValueError(f"file {path!r} is larger than {MAX_FILE_CHARS} characters")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class RolloutInfo(Reply):
    """One rollout as the platform sees it."""

    id: str
    job_id: str
    rollout_id: str = Field(description="its trajectory's rollout id (job_id, rollout_id)")
    state: RolloutState
    sandbox_id: str | None = None
    project: str | None = Field(
        None, description="the project its sandbox is charged to (who may see it)"
    )
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    deadline: datetime
    exit_code: int | None = Field(None, description="the scaffold's, as the platform saw it")
    reward: float | None = None
    verdict: VerifyResult | None = None
    judgement: JudgeResult | None = None
    model_calls: int = Field(
        0, description="model calls the model answered (one model_call step each)"
    )
    model_retries: int = Field(0, description="upstream attempts that failed and were retried")
    error: str | None = None
    acked: bool = False


class RolloutResult(Reply):
    """A finished (or failed/cancelled) rollout handed to the trainer: the rollout and
    its whole trajectory."""

    rollout: RolloutInfo
    steps: list[StepRecord] = Field(default_factory=list)


class AckRequest(Strict):
    ids: list[str] = Field(..., min_length=1, max_length=10_000)


class AckResult(Reply):
    acked: list[str] = Field(default_factory=list, description="acknowledged by this call")
    already: list[str] = Field(default_factory=list, description="acknowledged before")
    unknown: list[str] = Field(
        default_factory=list, description="not rollouts of the job, or not finished yet"
    )


class EndpointSet(Reply):
    job_id: str
    endpoint: ModelEndpointInfo
    rollouts: int = Field(0, description="live rollouts of the job that now use it")


def redact_spec(spec: RolloutSpec) -> dict[str, Any]:
    """A spec as it may be shown: the model key left out."""
    body = spec.model_dump(mode="json")
    if body.get("model"):
        body["model"].pop("api_key", None)
    return body
