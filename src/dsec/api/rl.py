"""RL co-design on the wire: job pause/resume reports, pack_diff and fork.

The bodies and answers of /v1/jobs and /v1/sandboxes/{id}/pack|fork.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from dsec.api.base import Reply, Strict
from dsec.api.layers import LayerInfo, check_layer_name, check_layer_version
from dsec.api.sandbox import SandboxInfo
from dsec.api.spec import DSecContainerRunArgs, DSecMicroVMRunArgs

JOB_ID_MAX = 128


class SandboxPause(Reply):
    """One sandbox of a job pause: what was reclaimed and how long it took."""

    sandbox_id: str
    memory_before_bytes: int | None = None
    memory_after_bytes: int | None = None
    anon_bytes: int | None = Field(None, description="anonymous memory left after the pause")
    anon_before_bytes: int | None = Field(None, description="anonymous memory before it")
    swap_bytes: int | None = Field(None, description="the sandbox's memory in swap after it")
    duration: float = Field(..., description="seconds: freeze + reclaim (no queueing)")
    freeze_seconds: float = 0.0
    reclaim_seconds: float = 0.0
    error: str | None = None


class JobPauseReport(Reply):
    """Answer of pause_job: per job, not per sandbox, because a trainer pauses a job."""

    job_id: str
    paused: int = Field(..., description="sandboxes frozen by this call")
    already_paused: int = 0
    failed: int = 0
    memory_reclaimed_bytes: int = Field(..., description="cgroup usage before minus after")
    memory_before_bytes: int = 0
    duration: float = Field(..., description="seconds for the whole job")
    swap_available: bool = Field(
        ..., description="False: anonymous memory cannot leave RAM on this host"
    )
    sandboxes: list[SandboxPause] = Field(default_factory=list)
    anon_before_bytes: int = Field(0, description="anonymous memory before the pause")
    anon_after_bytes: int = Field(0, description="anonymous memory left in RAM after it")

    @model_validator(mode="after")
    def _anon_totals(self) -> JobPauseReport:
        """Totals from the sandboxes when a merger (the cluster router) left them out."""
        ok = [p for p in self.sandboxes if p.error is None]
        if not self.anon_before_bytes:
            self.anon_before_bytes = sum(p.anon_before_bytes or 0 for p in ok)
        if not self.anon_after_bytes:
            self.anon_after_bytes = sum(p.anon_bytes or 0 for p in ok)
        return self

    @property
    def anon_returned_fraction(self) -> float | None:
        """Share of the sandboxes' anonymous memory that left RAM (None: there was none)."""
        if not self.anon_before_bytes:
            return None
        return 1 - self.anon_after_bytes / self.anon_before_bytes


class JobResumeReport(Reply):
    job_id: str
    resumed: int
    duration: float
    sandbox_ids: list[str] = Field(default_factory=list)
    prefetched_bytes: int = Field(
        0,
        description="bytes of the resumed sandboxes' mappings read back from swap ahead "
        "of use (MADV_WILLNEED) by the time it answered; 0 with DSEC_RESUME_PREFETCH=0",
    )
    prefetch_pending: int = Field(
        0, description="sandboxes whose prefetch was still going on when this answered"
    )


class PackRequest(Strict):
    """Turn a sandbox's writable upper into a layer ``name:version``."""

    name: str = Field(..., description="layer name in the layer registry")
    version: str = Field("latest", description="layer version")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_layer_name(v)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_layer_version(v)


class PackedEnv(Reply):
    """A packed environment: the layer and how to start a sandbox from it.

    ``workspace``/``toolkit`` say in which slot the layer goes (the first slot the
    source sandbox left free above its own layers), so a new sandbox with the same
    image, workspace and toolkit as the source sees exactly the source's files.
    """

    layer: LayerInfo
    container_image: str
    workspace: str | None = None
    toolkit: str | None = None
    source_sandbox: str
    files: int = Field(0, description="entries in the layer (whiteouts included)")
    excluded: list[str] = Field(default_factory=list, description="paths left out")
    frozen_seconds: float = Field(0.0, description="how long the source was frozen")
    duration: float = 0.0

    def run_args(self, **overrides: object) -> DSecContainerRunArgs:
        """The spec of a sandbox that starts from this environment (plus ``overrides``)."""
        base = {"container_image": self.container_image, **self._layers(), **overrides}
        return DSecContainerRunArgs.model_validate(base)

    def microvm_run_args(self, **overrides: object) -> DSecMicroVMRunArgs:
        """The same environment booted as a microVM (the layers are the same blobs)."""
        base = {"image": self.container_image, **self._layers(), **overrides}
        return DSecMicroVMRunArgs.model_validate(base)

    def _layers(self) -> dict[str, object]:
        slots = {"workspace": self.workspace, "toolkit": self.toolkit}
        return {k: v for k, v in slots.items() if v is not None}


class ForkRequest(Strict):
    n: int = Field(..., ge=1, le=256, description="children to start")
    name: str | None = Field(None, description="layer name; default fork-<sandbox>")
    version: str | None = Field(None, description="layer version; default a timestamp")
    timeout: float = Field(120.0, gt=0, le=3600, description="per-child create timeout")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return check_layer_name(v) if v is not None else v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        return check_layer_version(v) if v is not None else v


class ForkResult(Reply):
    env: PackedEnv
    children: list[SandboxInfo]
    duration: float
