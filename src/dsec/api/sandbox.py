"""Sandboxes on the wire: states, the create request and what inspecting one answers."""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.fields import check_network_rules
from dsec.api.spec import BackendKind, RunArgs

# The Idempotency-Key header of a create (dsec.edge.idempotency): UUIDs, base64, ULIDs.
IDEMPOTENCY_HEADER = "Idempotency-Key"


IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9._:~+/=-]{1,255}$")


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


class NetworkRules(Strict):
    """A running sandbox's new egress rules: they REPLACE the old ones (no merge)."""

    network_rules: dict[str, bool] = Field(
        default_factory=dict, description="egress by service name or IPv4 rule; {} = none"
    )

    @field_validator("network_rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)


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
    spec: RunArgs
    accelerator: str | None = Field(
        None,
        description="what executes a VM sandbox's guest: 'kvm' (hardware) or 'tcg' "
        "(software emulation); None for containers",
    )
    data_path: DataPathInfo | None = Field(
        None, description="direct data path (create and inspect answers only)"
    )


class CreateSandboxRequest(Strict):
    spec: RunArgs
    timeout: float = Field(120, gt=0, le=3600)


class SandboxStats(Reply):
    """What one live sandbox uses now (``GET /v1/stats``, ``dsec top``), read from its
    cgroup when asked; None where its backend or the host cannot say."""

    id: str
    backend: BackendKind
    state: SandboxState
    image: str
    job_id: str | None = None
    edge: str
    created_at: datetime
    idle_seconds: float = Field(description="since its last command (0 after an edge restart)")
    memory_bytes: int | None = None
    cpu_seconds: float | None = Field(None, description="CPU time used so far; rate = delta/dt")
    disk_bytes: int | None = None
