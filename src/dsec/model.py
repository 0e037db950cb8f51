"""The shared language of the platform: run specs, states, results.

One spec per backend, one base for what every backend shares (paper Listing 1).
These models are the wire format of the HTTP API too, so the SDK, the apiserver and
the edge cannot disagree about a field. Unknown fields are refused: a typo such as
``memory_limit=`` must fail loudly, not be ignored.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.api.layers import ImageLoading, LayerRef
from dsec.api.protected import ProtectedMount, check_protected

# `name:tag` or `name` (tag defaults to latest); names like registry paths are allowed.
IMAGE_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
USER_RE = re.compile(r"^([a-z_][a-z0-9_-]{0,31}|\d{1,10}(:\d{1,10})?)$")
# Job, trajectory and rollout ids: safe in URLs, file names and log lines.
TRAJECTORY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,16}-[0-9a-f]{16}$")
# The Idempotency-Key header of a create (dsec.edge.idempotency): UUIDs, base64, ULIDs.
IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9._:~+/=-]{1,255}$")
# A project is a path in the project tree ("rl", "rl/math", "rl/math/job-42").
PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}(/[a-z0-9][a-z0-9._-]{0,62}){0,7}$")

MAX_OUTPUT_BYTES = 64 * 1024 * 1024


class Strict(BaseModel):
    """Requests: an unknown field is a caller's typo and must fail loudly."""

    model_config = ConfigDict(extra="forbid", frozen=False)


class Reply(BaseModel):
    """Responses: an older SDK must keep working when a newer server adds fields."""

    model_config = ConfigDict(extra="ignore", frozen=False)


class BackendKind(StrEnum):
    CONTAINER = "container"
    FNCALL = "fncall"
    MICROVM = "microvm"
    FULLVM = "fullvm"


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    # Frozen by a job-level pause (dsec.rl.jobs): all state kept, thawed by the next
    # request to it or by resume_job.
    PAUSED = "paused"
    # Cluster mode: its edge stopped answering (dsec.cluster); `reason` says which and
    # since when. An edge that comes back re-adopts the sandbox if it is still alive.
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        return self in (SandboxState.STOPPED, SandboxState.FAILED, SandboxState.LOST)


def parse_image_ref(ref: str) -> tuple[str, str]:
    """Split ``name[:tag]``; the tag defaults to ``latest``."""
    if not IMAGE_REF_RE.match(ref):
        raise ValueError(
            f"invalid image reference {ref!r}: expected name[:tag] with lowercase name "
            "characters [a-z0-9._/-], for example 'busybox:latest'"
        )
    name, _, tag = ref.partition(":")
    return name, tag or "latest"


def _check_abs_path(value: str, what: str) -> str:
    if not value.startswith("/") or "\x00" in value or len(value) > 4096:
        raise ValueError(f"{what} must be an absolute path without NUL bytes, got {value!r}")
    return value


# A raw IPv4 rule: address or CIDR, optionally ":" and ports ("10.0.0.0/8:80,443,8000-8100").
NETWORK_IP_RULE_RE = re.compile(r"^[0-9.]{7,15}(/\d{1,2})?(:[0-9,-]{1,100})?$")


def check_network_rules(v: dict[str, bool]) -> dict[str, bool]:
    """Shape only (service names and IPv4 rules); the edge checks them against its
    catalog (dsec.net.catalog)."""
    for key in v:
        if not (LABEL_KEY_RE.match(key) or NETWORK_IP_RULE_RE.match(key)):
            raise ValueError(
                f"invalid network rule {key!r}: use a service name such as 'pypi' or an "
                "IPv4 rule such as '10.1.2.3', '10.0.0.0/8' or '10.1.2.3:443,8000-8100'"
            )
    if len(v) > 256:
        raise ValueError("at most 256 network rules")
    return v


class NetworkRules(Strict):
    """A running sandbox's new egress rules: they REPLACE the old ones (no merge)."""

    network_rules: dict[str, bool] = Field(
        default_factory=dict, description="egress by service name or IPv4 rule; {} = none"
    )

    @field_validator("network_rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)


class DSecRunArgs(Strict):
    """What every backend shares. Subclasses add what is specific to one backend."""

    memory_limit_mb: int = Field(512, ge=16, le=1024 * 1024, description="hard memory limit")
    cpu_cores_limit: float = Field(1.0, gt=0, le=1024, description="CPU quota in cores")
    pids_limit: int = Field(1024, ge=16, le=65536, description="max processes and threads")
    disk_limit_mb: int | None = Field(
        None,
        ge=64,
        le=16 * 1024 * 1024,
        description="writable disk (files written, metadata included), kernel-enforced; "
        "writes past it fail with EDQUOT inside the sandbox. None: 10 GiB, or the host's "
        "whole sandbox disk if that is smaller",
    )
    ttl_running_stop: int | None = Field(
        300, ge=1, le=30 * 86400, description="idle seconds before an automatic stop; None=never"
    )
    network_rules: dict[str, bool] = Field(
        default_factory=dict, description="egress by service name; empty = loopback only"
    )
    init_user: str = Field("root", description="user name in the image, or uid[:gid]")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    job_id: str | None = Field(
        None,
        pattern=TRAJECTORY_NAME_RE.pattern,
        description="RL job this sandbox serves; tags audit and events ([A-Za-z0-9._:@-])",
    )
    trajectory_id: str | None = Field(
        None,
        pattern=TRAJECTORY_NAME_RE.pattern,
        description="rollout within the job; tags audit and events",
    )
    project: str | None = Field(
        None,
        pattern=PROJECT_RE.pattern,
        description="project charged for this sandbox (a path like 'rl/math'); None: the "
        "caller's default project",
    )

    @field_validator("init_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not USER_RE.match(v):
            raise ValueError(f"init_user must be a user name or uid[:gid], got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not ENV_KEY_RE.match(key):
                raise ValueError(f"invalid environment variable name {key!r}")
            if "\x00" in val:
                raise ValueError(f"environment variable {key} contains a NUL byte")
        if len(v) > 1024:
            raise ValueError("at most 1024 environment variables")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not LABEL_KEY_RE.match(key):
                raise ValueError(f"invalid label key {key!r}: use [A-Za-z0-9._/-], <= 63 chars")
            if len(val) > 256 or "\x00" in val:
                raise ValueError(f"label {key} value is longer than 256 chars or has a NUL")
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        return v

    @field_validator("network_rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        return _check_abs_path(v, "workdir")


class DSecContainerRunArgs(DSecRunArgs):
    """A Linux container started from a layered image (paper Listing 1)."""

    backend: Literal["container"] = "container"
    container_image: str = Field(..., description="image reference name[:tag]")
    # Composable layers (stacked on the base image in this order) and how they load.
    workspace: LayerRef | None = Field(None, description="layer name:version or digest")
    toolkit: LayerRef | None = Field(None, description="layer name:version or digest")
    image_loading: ImageLoading = Field(
        "lazy", description="lazy: fetch chunks on first read; eager: whole layers first"
    )
    # Grader/answer content that only verify() runs see (dsec.protected_model).
    protected: list[ProtectedMount] = Field(
        default_factory=list, description="paths only verifier runs can read"
    )

    @field_validator("protected")
    @classmethod
    def _protected(cls, v: list[ProtectedMount]) -> list[ProtectedMount]:
        return check_protected(v)

    @field_validator("container_image")
    @classmethod
    def _image(cls, v: str) -> str:
        parse_image_ref(v)
        return v


RunArgs = Annotated[DSecContainerRunArgs, Field(discriminator="backend")]


class DataPathInfo(Reply):
    """How to reach a sandbox's edge directly: base URL plus a sandbox token.

    The token is HMAC-signed by the edge, expires, and works for this sandbox only; send
    it as ``Authorization: Bearer <token>`` to the ``/v1/edge/...`` routes under ``url``.
    """

    url: str
    token: str
    expires_at: datetime


class SandboxInfo(Reply):
    id: str
    backend: BackendKind
    state: SandboxState
    image: str
    labels: dict[str, str] = Field(default_factory=dict)
    created_at: datetime
    updated_at: datetime
    reason: str | None = Field(None, description="why it failed or stopped")
    edge: str
    spec: DSecContainerRunArgs
    data_path: DataPathInfo | None = Field(
        None, description="direct data path (create and inspect answers only)"
    )


class CreateSandboxRequest(Strict):
    spec: DSecContainerRunArgs
    timeout: float = Field(120, gt=0, le=3600)


class TrajectoryRef(Strict):
    """Which step of which rollout a state-changing request is (see dsec.rl.trajectory):
    logged before it is answered, answered from the log when sent again."""

    job_id: str = Field(pattern=TRAJECTORY_NAME_RE.pattern)
    rollout_id: str = Field(pattern=TRAJECTORY_NAME_RE.pattern)
    step: int = Field(ge=0, le=1 << 40)


class ExecRequest(Strict):
    """One command. A string runs through ``/bin/sh -c``; a list is an argv."""

    command: str | list[str]
    trajectory: TrajectoryRef | None = Field(
        None, description="log and replay this command as a step of a trajectory"
    )
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0, le=86400, description="seconds; kills the command")
    stdin: str | None = Field(None, description="text fed to the command's stdin")
    max_output_bytes: int = Field(16 * 1024 * 1024, ge=1, le=MAX_OUTPUT_BYTES)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not v or not v[0]:
                raise ValueError("command argv must be a non-empty list")
            if any("\x00" in a for a in v):
                raise ValueError("command arguments must not contain NUL bytes")
        elif not v.strip() or "\x00" in v:
            raise ValueError("command must be a non-empty string without NUL bytes")
        return v

    @field_validator("workdir")
    @classmethod
    def _wd(cls, v: str | None) -> str | None:
        return None if v is None else _check_abs_path(v, "workdir")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not USER_RE.match(v):
            raise ValueError(f"user must be a user name or uid[:gid], got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not ENV_KEY_RE.match(key) or "\x00" in val:
                raise ValueError(f"invalid environment variable {key!r}")
        return v


class ExecResult(Reply):
    exit_code: int = Field(description="exit status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    duration: float = Field(description="seconds from start to exit inside the sandbox")
    timed_out: bool = False
    truncated: bool = Field(False, description="output beyond max_output_bytes was dropped")


class ImageInfo(Reply):
    name: str
    tag: str
    digest: str = Field(description="digest of the image manifest")
    layers: list[str] = Field(description="layer digests, bottom first")
    size_bytes: int
    created_at: datetime
    config: dict[str, object] = Field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


class BuildImageRequest(Strict):
    recipe: Literal["busybox", "debian-python"]
    name: str | None = None
    rebuild: bool = False


class Degradation(Reply):
    """One reason the platform is degraded: an exhausted resource (``resource``) or a
    background component that died and is being restarted (``component``)."""

    resource: str | None = None
    component: str | None = None
    since: float  # unix time it started
    reason: str
    what_to_do: str | None = None
    restarts: int | None = None


class HealthInfo(Reply):
    """``degraded`` while a resource is exhausted or a component is down (``degraded``
    lists why and since when); ``ok`` again once it is back, without a restart."""

    status: Literal["ok", "degraded"] = "ok"
    version: str
    edge: str
    sandboxes_running: int
    capacity: int
    degraded: list[Degradation] = []
    # The backends this edge runs (probed at start), and why each other one is not.
    backends: list[str] = []
    backends_unavailable: dict[str, str] = {}
