"""The one narrow interface every backend implements (Firecracker/containerd style).

The edge owns the lifecycle state machine and durability; a backend only turns a
record into running kernel objects and back. Capabilities a backend lacks raise
``Unsupported`` - never a silent no-op.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from dsec.api.desktop import ComputerAction
from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import BackendKind, DSecRunArgs, RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.errors import Unsupported
from dsec.sessions.agent_client import AgentClient

if TYPE_CHECKING:
    from dsec.config import PlatformConfig
    from dsec.images.mounts import LayerMounts
    from dsec.images.vmdisk import VMMachine
    from dsec.resources.cgroups import CgroupHost
    from dsec.security.audit import AuditSink


class BackendFacts(ABC):
    """What a backend keeps about one of its sandboxes (paths, pids, held layers),
    persisted with the record (edge.db) as JSON. The edge reads only what this
    interface names; everything else is the backend's own business."""

    @property
    @abstractmethod
    def init_pid(self) -> int | None:
        """The host pid of the sandbox's init (the edge watches it die and reads its
        root for the tamper scan), None when there is none."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable; ``Backend.load_facts`` reads it back."""

    @property
    def accelerator(self) -> str | None:
        """What executes a VM's guest ("kvm", "tcg"), for ``SandboxInfo``; None: not a VM."""
        return None


@dataclass(frozen=True)
class StoredFacts(BackendFacts):
    """Facts as stored in edge.db, not (yet) read by their backend: a record loaded
    before its backend parsed it, one whose kind no backend here runs, or one whose
    create has not returned. Opaque to the edge."""

    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def init_pid(self) -> int | None:
        return None

    def to_json(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass(frozen=True)
class CreateInput:
    """Everything the edge decided for a create, handed to ``Backend.create`` typed
    and read-only: the backend writes nothing back into the edge's record (what it
    keeps comes back as its ``BackendFacts``)."""

    id: str
    spec: RunArgs  # inline protected contents redacted (as persisted)
    image: ImageInfo  # the composed image: base + workspace + toolkit layers
    # Per spec.protected mount: its layer resolved to a digest, None for inline files.
    protected_layers: tuple[str | None, ...] = ()
    # Per spec.protected mount: its inline files. Never persisted, never answered.
    protected_files: tuple[Mapping[str, str], ...] = field(default=(), repr=False)
    # The sandbox's network from dsec.net (egress rules), None: loopback only.
    net: Mapping[str, Any] | None = None


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
    # The backend's facts (its create's answer); persisted.
    facts: BackendFacts = field(default_factory=StoredFacts)
    # The edge's: the network dsec.net attached (egress rules), persisted for adopt.
    net: dict[str, Any] | None = None
    # The data plane's: open sessions (live restore), persisted.
    sessions: dict[str, dict[str, str]] = field(default_factory=dict)
    # Not persisted: reset to "now" after a restart, which only ever extends a TTL.
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def default_workdir(self) -> str:
        """Where commands run unless they say: the spec's workdir, or the image's
        WORKDIR (a Dockerfile build's) when the spec leaves the default ``/``."""
        if self.spec.workdir != "/":
            return self.spec.workdir
        image_dir = self.image.config.get("workdir")
        if isinstance(image_dir, str) and image_dir.startswith("/") and "\x00" not in image_dir:
            return image_dir
        return "/"

    @property
    def default_user(self) -> str:
        """Who commands run as unless they say: the spec's init_user, or the image's
        USER (a Dockerfile build's) when the spec leaves the default ``root``. File
        operations stay with init_user."""
        if self.spec.init_user != "root":
            return self.spec.init_user
        image_user = self.image.config.get("user")
        if isinstance(image_user, str) and image_user and "\x00" not in image_user:
            return image_user
        return "root"

    @property
    def kind(self) -> BackendKind:
        """Which backend runs the sandbox (the spec's ``backend``)."""
        return BackendKind(self.spec.backend)

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            backend=self.kind,
            state=self.state,
            image=self.spec.image_ref,
            labels=dict(self.spec.labels),
            created_at=self.created_at,
            updated_at=self.updated_at,
            reason=self.reason,
            edge=self.edge,
            spec=self.spec,
            accelerator=self.facts.accelerator,
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


class Capability(StrEnum):
    """What a backend can do beyond create/exec/destroy; the edge refuses a request that
    needs one its backend lacks (Unsupported, 501) before doing any work, instead of
    finding out half-way. One flag per optional group of ``Backend`` methods, or per
    spec field whose enforcement is the backend's."""

    SESSIONS = "sessions"  # agent(), command_env(): sessions, processes, streams, file ops
    FILES = "files"  # read_file, write_file
    PAUSE = "pause"  # pause, reclaim, resume, adopt_paused: job pause/resume
    VERIFY = "verify"  # verify: a grader in a pristine verifier
    PROTECTED_PATHS = "protected_paths"  # spec.protected (seen by verify steps only)
    PACK = "pack"  # pack_writable: pack_diff
    FORK = "fork"  # pack_writable + create: fork
    NETWORK_RULES = "network_rules"  # spec.network_rules (egress allow-rules), updates
    DISK_LIMIT = "disk_limit"  # spec.disk_limit_mb
    SNAPSHOT = "snapshot"  # snapshot: a running VM saved as a VM image (memory + disk)
    COMPUTER_USE = "computer_use"  # screenshot, computer_input: the VM's display and input
    QOS = "qos"  # spec.qos == "best_effort" enforced (SCHED_IDLE, low CPU weight)


@dataclass(frozen=True)
class BackendHost:
    """What the platform hands every backend it builds (``Backend.from_host``): the
    host-wide parts all backends share, so that adding a backend changes no wiring."""

    config: PlatformConfig
    layers: LayerMounts  # EROFS layers mounted once per host
    cgroups: CgroupHost
    audit: AuditSink
    agent_binary: Path  # the static in-sandbox agent (dsec.agent.build)


class Backend(ABC):
    kind: ClassVar[BackendKind]
    # What this backend does of the optional part of the interface (see Capability).
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    # How a sandbox with network rules is attached (dsec.net): a network namespace with
    # a veth a container joins, or a tap device a VM's VMM is handed (dsec.net.vmtap).
    network_device: ClassVar[Literal["veth", "tap"]] = "veth"
    # Whether a paused sandbox must be resumed before ``destroy`` can kill it (frozen
    # cgroup tasks ignore SIGKILL until thawed; a VM paused to a file has nothing to
    # thaw, and resuming it would restore a whole VM only to kill it).
    destroy_needs_resume: ClassVar[bool] = True
    # Whether ``reclaim`` ends every connection to the agent (a VM paused to a file has
    # no VMM and so no channel): the data plane then stops following the sandbox's
    # background processes before the reclaim and follows them again once resumed.
    reclaim_drops_agent_links: ClassVar[bool] = False

    def committed_memory_mb(self, spec: DSecRunArgs, overcommit: float) -> int:
        """What admitting ``spec`` commits of the host's memory budget (host memory
        times ``overcommit``). A container uses a fraction of its limit, so its limit
        counts; a backend whose sandboxes hold their memory once touched (a VM's guest
        RAM, with its VMM's own) counts that at full weight."""
        return spec.memory_limit_mb

    def helper_vm_memory_mb(self, spec: DSecRunArgs, overcommit: float) -> int | None:
        """What the helper VM of a verify or pack step of a sandbox with ``spec``
        commits (admission holds it, and a slot, for the step's length); None when the
        step runs in the platform's own processes and needs no VM."""
        return None

    @classmethod
    def probe(cls) -> str | None:
        """Can this host run the backend? None when it can, else why not (shown by
        /v1/health). Cheap and side-effect free: it runs at every edge start, for
        backends that were not asked for too (the default enables every one that can)."""
        return None

    @classmethod
    @abstractmethod
    def from_host(cls, host: BackendHost) -> Self:
        """Build the backend for this host (dsec.backends.registry calls it)."""

    @classmethod
    def require(cls, capability: Capability) -> None:
        """Raise Unsupported (501), naming backend and capability, if this backend
        lacks ``capability``: call it before any work."""
        if capability not in cls.capabilities:
            raise Unsupported(
                f"the {cls.kind.value} backend does not support {capability.value}",
                backend=cls.kind.value,
                capability=capability.value,
            )

    def capabilities_of(self, rec: SandboxRecord) -> frozenset[Capability]:
        """What this backend does for the sandbox ``rec``: ``capabilities``, unless a
        sandbox's own guest adds to them (a full VM whose image runs DSec's agent has
        sessions; one without has not)."""
        return self.capabilities

    def require_of(self, rec: SandboxRecord, capability: Capability) -> None:
        """``require`` for one sandbox (``capabilities_of``): Unsupported (501)."""
        if capability not in self.capabilities_of(rec):
            raise Unsupported(
                f"the {self.kind.value} backend does not support {capability.value}"
                + ("" if capability in self.capabilities else f" for sandbox {rec.id}"),
                backend=self.kind.value,
                capability=capability.value,
            )

    async def start(self) -> None:
        """Prepare the host (binaries, directories); called once before any create."""

    def details(self) -> Mapping[str, str]:
        """What this backend runs on, for ``/v1/health`` (``backend_details``): e.g. the
        microVM accelerator and why not the other. Cheap: answered from memory."""
        return {}

    async def close(self) -> None:
        """Release host-level resources the backend holds (not the sandboxes)."""

    @abstractmethod
    async def create(self, inp: CreateInput) -> BackendFacts:
        """Start the sandbox; returns what to keep of it (the record's ``facts``). On
        failure (or cancellation) leaves nothing behind."""

    def load_facts(self, data: Mapping[str, Any]) -> BackendFacts:
        """Read back what ``BackendFacts.to_json`` stored (after an edge restart); the
        current release reads every release's records."""
        return StoredFacts(dict(data))

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
        """After an edge restart, before ``adopt``: does the sandbox still run, and can
        we talk to it? It may take back what the crashed edge left half-done (a verify
        step's verifier, a VMM it stopped) and link to the sandbox anew: only the
        restart's recovery calls it. A sandbox this process tracks is asked
        ``still_running`` instead."""

    @abstractmethod
    async def still_running(self, rec: SandboxRecord) -> bool:
        """For a sandbox this edge process created or adopted: does it still run?

        Asked by the data path when a request failed with a BackendError: did the
        sandbox die, or did only this request fail? Answered from what the backend
        tracks (its init or VMM process), with no side effect. A verify, pack or pause
        of this process may be holding the sandbox still right now, so nothing here
        links anew, thaws, continues or recovers anything, and an agent that cannot
        answer while its sandbox is held is not a dead one. (``is_alive`` did all of
        that here once: a failed request during a microVM verify continued the VM
        and killed its verifier, and replaced the VM's tracked state.)"""

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

    def spec_for_image(self, spec: RunArgs, image: ImageInfo) -> RunArgs:
        """The spec as its resolved image completes it, before admission and the
        network (default: unchanged). A full VM's snapshot brings the network rules
        it was saved with when the spec names none (its machine has a NIC)."""
        return spec

    def death_reason(self, rec: SandboxRecord) -> str | None:
        """Why the sandbox's init ended, when the backend knows better than its exit
        status (a VM whose guest shut down, panicked or broke its agent channel, whose
        VMM the backend then ended); None: the edge says how the init died."""
        return None

    def watch_init_channel(self, rec: SandboxRecord, on_closed: Callable[[str], None]) -> bool:
        """Whether the backend holds, now, a connection that ends when the init of
        ``rec`` does; then it calls ``on_closed(sandbox_id)`` when that connection
        ends, and the edge's death watch spends no fd of its own on the sandbox
        (dsec.edge.deaths). False (the default): the edge holds a pidfd."""
        return False

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

    def limit_cgroup(self, rec: SandboxRecord) -> str | None:
        """The cgroup (relative to the hierarchies' roots) whose kernel notifications
        say when :meth:`limit_counters` moved, or None when this backend has none."""
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

    async def reclaim_idle(self, rec: SandboxRecord, *, anon: bool) -> ReclaimFigures:
        """Give back the cold memory of a *running* sandbox that has been idle (page
        cache; anonymous memory to swap too where ``anon``), without stopping it
        (dsec.edge.idle)."""
        raise Unsupported(f"the {self.kind} backend cannot reclaim an idle sandbox yet")

    async def prefetch(
        self, rec: SandboxRecord, *, swapped: tuple[int, int | None] = (0, None)
    ) -> int:
        """After a resume: read the sandbox's swapped-out memory back ahead of use
        (dsec.resources.prefetch); bytes of mappings advised. ``swapped`` = (lo, hi):
        only processes with more than lo and at most hi bytes in swap."""
        raise Unsupported(f"the {self.kind} backend cannot prefetch a resumed sandbox")

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

    async def snapshot(self, rec: SandboxRecord, *, state_out: Path, disk_out: Path) -> VMMachine:
        """Save the running sandbox (a VM) as the parts of a snapshot VM image: its
        memory and device state into ``state_out``, its disk flattened into the
        standalone qcow2 ``disk_out`` (both new files no sandbox can write), with the
        VM frozen across both and running on after; returns the machine shape a
        restore needs. On failure neither file is left and the VM runs on."""
        raise Unsupported(f"the {self.kind} backend cannot snapshot sandboxes yet")

    # -- computer use: the sandbox's screen and input devices ---------------------------
    async def screenshot(self, rec: SandboxRecord) -> bytes:
        """The sandbox's screen as PNG bytes (read from its display adapter, not by
        software in the sandbox)."""
        raise Unsupported(f"the {self.kind} backend has no display")

    async def computer_input(self, rec: SandboxRecord, action: ComputerAction) -> None:
        """Send one pointer or keyboard action to the sandbox's input devices."""
        raise Unsupported(f"the {self.kind} backend has no input devices")

    async def desktop_socket(self, rec: SandboxRecord) -> Path:
        """The unix socket of the sandbox's VNC server (the live view): a host path only
        the edge can reach, whose bytes the guest controls (relayed, never parsed)."""
        raise Unsupported(f"the {self.kind} backend has no live view")
