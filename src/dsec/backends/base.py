"""The one narrow interface every backend implements (Firecracker/containerd style).

The edge owns the lifecycle state machine and durability; a backend only turns a
record into running kernel objects and back. Capabilities a backend lacks raise
``Unsupported`` - never a silent no-op.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import BackendKind, RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.errors import Unsupported
from dsec.sessions.agent_client import AgentClient


@dataclass
class SandboxRecord:
    """Everything the edge knows about one sandbox; persisted on every state change."""

    id: str
    spec: RunArgs
    image: ImageInfo
    state: SandboxState
    created_at: datetime
    updated_at: datetime
    edge: str
    reason: str | None = None
    # Facts owned by the backend (paths, pids); JSON-serialisable.
    runtime: dict[str, Any] = field(default_factory=dict)
    # Not persisted: reset to "now" after a restart, which only ever extends a TTL.
    last_activity: float = field(default_factory=time.monotonic)
    # Not persisted: handed from the edge to the backend's create only (inline
    # protected file contents, which must never reach edge.db or a SandboxInfo).
    transient: dict[str, Any] = field(default_factory=dict, repr=False)

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            backend=BackendKind(self.spec.backend),
            state=self.state,
            image=self.spec.image_ref,
            labels=dict(self.spec.labels),
            created_at=self.created_at,
            updated_at=self.updated_at,
            reason=self.reason,
            edge=self.edge,
            spec=self.spec,
        )


@dataclass(frozen=True)
class ReclaimFigures:
    """What a paused sandbox's reclaim achieved, in bytes (None: the host cannot say)."""

    before: int | None
    after: int | None
    anon_before: int | None
    anon_after: int | None
    swap: int | None


@dataclass(frozen=True)
class PackedWritable:
    """What ``pack_writable`` put in the layer: entries, and the paths it left out."""

    files: int
    excluded: list[str]


class Backend(ABC):
    kind: BackendKind

    async def start(self) -> None:
        """Prepare the host (binaries, directories); called once before any create."""

    async def close(self) -> None:
        """Release host-level resources the backend holds (not the sandboxes)."""

    @abstractmethod
    async def create(self, rec: SandboxRecord) -> None:
        """Start the sandbox; fills ``rec.runtime``. On failure leaves nothing behind."""

    @abstractmethod
    async def destroy(self, rec: SandboxRecord) -> None:
        """Stop and remove every kernel object; idempotent, works on half-created ones."""

    @abstractmethod
    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult: ...

    @abstractmethod
    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes: ...

    @abstractmethod
    async def write_file(
        self, rec: SandboxRecord, path: str, data: bytes, *, mode: int
    ) -> None: ...

    @abstractmethod
    async def is_alive(self, rec: SandboxRecord) -> bool:
        """After a restart: does the sandbox still run, and can we talk to it?"""

    async def adopt(self, rec: SandboxRecord) -> None:
        """Take back a sandbox that survived an edge restart (re-take host references)."""

    @abstractmethod
    async def sweep(self, known_ids: set[str]) -> list[str]:
        """Remove leftovers (processes, mounts, cgroups, dirs) of sandboxes not in
        ``known_ids``; returns what was removed, for the log."""

    def agent(self, rec: SandboxRecord) -> AgentClient:
        """The in-sandbox agent, for sessions, streaming and file operations."""
        raise Unsupported(f"the {self.kind} backend has no session agent yet")

    def command_env(self, rec: SandboxRecord, extra: dict[str, str]) -> dict[str, str]:
        """The environment a command starts with: image, spec, then ``extra``."""
        raise Unsupported(f"the {self.kind} backend has no session agent yet")

    def writable_dir(self, rec: SandboxRecord) -> Path | None:
        """Where the sandbox's file changes land on the host (overlay upper), if any:
        detectors inspect it from outside without trusting the sandbox."""
        return None

    async def stats(self, rec: SandboxRecord) -> dict[str, Any]:
        return {}

    def check_limits(self, spec: RunArgs) -> None:
        """Refuse (LimitExceeded) limits this backend could never honour on this host."""

    def supervised(self) -> list[tuple[str, Callable[[], str | None], Callable[[], None]]]:
        """Thread-backed parts the edge's supervisor watches (dsec.supervise): each as
        (name, healthy() -> None or why not, restart())."""
        return []

    def loops(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """Periodic loops the edge's supervisor runs for this backend (dsec.supervise):
        each as (name, coroutine factory); restarted with backoff if one raises."""
        return []

    def disk_pressure(self) -> str | None:
        """Why sandboxes' writable disks are held below their configured limits right
        now (the host cannot back them), for ``/v1/health``; None while they are not."""
        return None

    def limit_counters(self, rec: SandboxRecord) -> Any:
        """The kernel's limit counters of a sandbox (a ``dsec.security.limits.LimitReading``),
        or None when this backend has none to offer."""
        return None

    async def verify(self, rec: SandboxRecord, req: VerifyRequest) -> VerifyResult:
        """Run a grader where the spec's protected paths and snapshots of the graded
        paths are visible, from the pristine image (a verifier step). Bad input is
        refused before the sandbox is touched."""
        raise Unsupported(f"the {self.kind} backend cannot run verifier steps yet")

    # -- pause (paper §6.3): freeze, then give memory back; resume thaws --------------
    def pause(self, rec: SandboxRecord) -> None:
        """Stop every process of the sandbox, at once and synchronously (it runs on the
        event loop under the edge's exclusive hold, so no request can see the sandbox
        running once it returns). Raises BackendError if it does not take."""
        raise Unsupported(f"the {self.kind} backend cannot pause sandboxes yet")

    async def reclaim(self, rec: SandboxRecord, *, swap: bool) -> ReclaimFigures:
        """Give a paused sandbox's memory back to the host (to swap where ``swap``)."""
        raise Unsupported(f"the {self.kind} backend cannot reclaim a paused sandbox yet")

    def resume(self, rec: SandboxRecord) -> None:
        """Undo ``pause`` (synchronously: the next request must find it running);
        idempotent, and a sandbox that is already gone is not an error."""
        raise Unsupported(f"the {self.kind} backend cannot resume sandboxes yet")

    async def adopt_paused(self, rec: SandboxRecord) -> bool:
        """After an edge restart: re-adopt a sandbox recorded as paused and keep it
        paused. False: it is gone."""
        return False

    async def pack_writable(
        self, rec: SandboxRecord, out: Path, *, compression: str | None, paused: bool
    ) -> PackedWritable:
        """Build the EROFS image ``out`` of the sandbox's changes (its writable layer,
        minus platform mounts and protected paths) with the sandbox held still
        meanwhile (``paused``: it already is). For pack_diff and fork (dsec.rl.pack).
        Raises Unsupported for a sandbox without a writable layer."""
        raise Unsupported(f"the {self.kind} backend cannot pack a sandbox")

    async def snapshot(self, rec: SandboxRecord) -> str:
        raise Unsupported(f"the {self.kind} backend cannot snapshot sandboxes yet")
