"""What the apiserver may ask of an edge. In-process today, over HTTP in cluster mode.

Every method raises typed errors from ``dsec.errors`` (SandboxNotFound,
SandboxNotRunning, ImageNotFound, AdmissionRejected, LimitExceeded, Unsupported,
Timeout, BackendError, FileNotFound, PermissionDenied, InvalidArgument).
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.health import HealthInfo
from dsec.api.sandbox import NetworkRules, SandboxInfo, SandboxState, SandboxStats
from dsec.api.spec import RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult

if TYPE_CHECKING:
    from dsec.edge.idempotency import IdempotencyClaim


class EdgeAPI(Protocol):
    edge_id: str

    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        """Admit, build the root file system, start; returns when the sandbox runs."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> list[SandboxInfo]: ...

    async def stop(self, sandbox_id: str, *, reason: str = "stopped by request") -> SandboxInfo:
        """Terminate and release everything; idempotent on a stopped sandbox."""
        ...

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        """Run a grader in a pristine verifier that sees the protected paths and
        snapshots of the graded ones (the agent frozen; stopped first in fresh mode)."""
        ...

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int) -> bytes: ...

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        trajectory: TrajectoryRef | None = None,
    ) -> None: ...

    async def health(self) -> HealthInfo: ...

    async def stats(self, sandbox_id: str | None = None) -> builtins.list[SandboxStats]:
        """Resource use of every live sandbox (a cluster: of every edge that answers);
        ``sandbox_id``: of that one only (empty if it is not live)."""
        ...

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        """Replace (not merge) a running sandbox's egress rules."""
        ...


@runtime_checkable
class NamedCreates(Protocol):
    """An edge that names a sandbox before making it: the in-process edge of a single
    node. The creator charges the quota under the final id up front, so a create needs
    no second quota write to move a provisional charge (dsec.apiserver.creator)."""

    def new_sandbox_id(self, spec: RunArgs | None = None) -> str:
        """A fresh id for a sandbox this edge will make; with ``spec``, the id of a warm
        sandbox of its shape when one is ready (dsec.edge.warmpool), held for the
        create_named that follows, or given back by forget_sandbox_id."""
        ...

    def forget_sandbox_id(self, sandbox_id: str) -> None:
        """No create_named will follow new_sandbox_id's ``sandbox_id`` (the caller
        failed first): whatever was held for it is free again. Idempotent."""
        ...

    async def create_named(self, spec: RunArgs, *, timeout: float, sandbox_id: str) -> SandboxInfo:
        """``create`` under ``sandbox_id`` (from new_sandbox_id). On failure whatever was
        held for the id stays held until forget_sandbox_id: the caller first gives back
        what it did under the id (its quota charge), else the next create handed the same
        warm sandbox would find that charge still on record."""
        ...


@runtime_checkable
class KeyedCreates(Protocol):
    """An edge that makes at most one sandbox per Idempotency-Key: the in-process edge
    of a single node (dsec.edge.idempotency) and the cluster router (dsec.cluster.keys)."""

    async def replay(self, claim: IdempotencyClaim, *, timeout: float) -> SandboxInfo | None:
        """The sandbox the key already made, or None; 409 if it went with another spec."""
        ...

    async def create_keyed(
        self, spec: RunArgs, *, timeout: float, claim: IdempotencyClaim
    ) -> tuple[SandboxInfo, bool]:
        """(info, made by this call)."""
        ...
