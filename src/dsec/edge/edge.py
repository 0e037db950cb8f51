"""The per-host edge: admission, the lifecycle state machine, TTLs and crash recovery.

The edge is the authority for its sandboxes. Every state change is written to its
durable store before it is acknowledged, so after a crash (SIGKILL) a new edge process
re-adopts what still runs, cleans up what was half-built, and sweeps anything on the
host that no record explains. Backends only build and tear down; they never decide.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import heapq
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dsec import __version__
from dsec.api.events import AuditKind, EventKind, Severity
from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.fields import SANDBOX_ID_RE, check_network_rules
from dsec.api.health import Degradation, HealthInfo
from dsec.api.images import ImageInfo
from dsec.api.rl import ForkRequest, ForkResult, JobPauseReport, JobResumeReport, PackedEnv
from dsec.api.sandbox import NetworkRules, SandboxInfo, SandboxState, SandboxStats
from dsec.api.spec import (
    BackendKind,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    RunArgs,
)
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.backends.base import Backend, BackendFacts, Capability, CreateInput, SandboxRecord
from dsec.backends.kinds import require_backend
from dsec.edge.admission import Admission
from dsec.edge.deaths import InitWatcher, describe
from dsec.edge.idempotency import IdempotencyClaim, IdempotencyKeys
from dsec.edge.idle import IdleReclaimer
from dsec.edge.state import EdgeStateDB
from dsec.edge.teardowns import UnfinishedTeardowns
from dsec.edge.ttl import IdleClocks
from dsec.edge.warmpool import Warm, WarmPool
from dsec.errors import (
    BackendError,
    DSecError,
    InvalidArgument,
    SandboxNotFound,
    SandboxNotRunning,
    Timeout,
    Unsupported,
)
from dsec.exhaustion import Exhaustion, Resource, register
from dsec.images.service import ImageService, LayerCacheBudget
from dsec.images.vmdisk import VMImage
from dsec.net.manager import NetworkManager
from dsec.observe.metrics import GaugeCollector, Metric, Metrics, counter, gauge, host_gauges
from dsec.resources import cgroups
from dsec.rl.jobs import JobControl
from dsec.rl.pack import fork_sandbox, pack_sandbox
from dsec.security.audit import AuditLog
from dsec.security.graded_paths import resolve_graded
from dsec.security.guard import DetectorGuard
from dsec.security.limits import LimitWatcher
from dsec.security.protected import protected_summary, redact_files
from dsec.security.tampering import MAX_REPORTED, TamperWatch, merged_names
from dsec.supervise import Supervisor

if TYPE_CHECKING:
    from dsec.rl.trajectory import TrajectoryService

log = logging.getLogger(__name__)
T = TypeVar("T")

DEATH_TEARDOWN_GRACE = 15.0  # seconds a close waits for teardowns of deaths it saw
LIVE_STATES = {
    SandboxState.CREATING,
    SandboxState.RUNNING,
    SandboxState.STOPPING,
    SandboxState.PAUSED,  # frozen by a job pause (dsec.rl.jobs): alive, holds resources
}
# Kinds kept warm (dsec.edge.warmpool): containers, whose idle cost is ~1.7 MiB of
# host memory. A VM's is its guest's memory, too much to hold for a guess.
WARM_KINDS = frozenset({BackendKind.CONTAINER})


def _now() -> datetime:
    return datetime.now(UTC)


def _outcome(res: ExecResult) -> dict[str, object]:
    """How a command ended, for its audit record."""
    out: dict[str, object] = {"exit_code": res.exit_code, "duration": round(res.duration, 6)}
    if res.timed_out:
        out["timed_out"] = True
    if res.truncated:
        out["truncated"] = True
    return out


class Edge:
    def __init__(
        self,
        *,
        edge_id: str,
        backends: Sequence[Backend],
        images: ImageService,
        state: EdgeStateDB,
        admission: Admission,
        ttl_interval: float = 1.0,
        stop_on_close: bool = True,
        audit: AuditLog | None = None,
        network: NetworkManager | None = None,
        data_dir: Path | None = None,
        unavailable: Mapping[BackendKind, str] | None = None,
        idle_reclaim_seconds: float = 0.0,
        reclaim_pressure: float = 10.0,
        resume_prefetch: bool = True,
        warm_per_shape: int = 0,
        warm_shapes: int = 4,
        warm_idle_seconds: float = 600.0,
        warm_grace_seconds: float = 5.0,
    ) -> None:
        self.audit = audit or AuditLog(None)
        # Prometheus metrics of this edge (dsec.observe.metrics), served at /metrics;
        # DSEC_METRICS=0 turns every update into a no-op (and /metrics into a 404).
        self.metrics = Metrics.from_env()
        self.audit.on_event(lambda ev: self.metrics.event(ev.kind.value))
        self.metrics.add(GaugeCollector(self._gauges))
        self.metrics.add(GaugeCollector(host_gauges))
        # Disk, fds, memory, pids running out: typed errors and health (dsec.exhaustion).
        self.exhaustion = Exhaustion(data_dir)
        register(self.exhaustion)  # the HTTP layer's last resort notes into it too
        # Background loops and threads restart themselves when they die (dsec.supervise).
        self.supervisor = Supervisor()
        # egress rules (dsec.net); None: sandboxes with allow-rules are Unsupported
        self.network = network
        if network is not None:  # denials and refusals happen there; counted here
            network.on_denied = self.metrics.egress_denied
            network.on_dns_refused = self.metrics.dns_refused
        self.tamper = TamperWatch()
        self.detectors = DetectorGuard(self.audit)  # a detector that raises never stops a hook
        # resource-limit events (OOM, pids, disk quota, output, timeout): dsec.security.limits
        # Event-driven: the kernel's cgroup notifications say which sandbox to read.
        self.limits = LimitWatcher(
            self.audit, self._limit_counters, host=cgroups.detect(), cgroup_of=self._limit_cgroup
        )
        self.edge_id = edge_id
        # One backend per enabled kind (dsec.backends.registry); the others, and why
        # not, for /v1/health.
        self.backends: dict[BackendKind, Backend] = {b.kind: b for b in backends}
        self.unavailable: dict[BackendKind, str] = dict(unavailable or {})
        # Writable disks clamped to what the host can back (dsec.resources.diskguard).
        self.exhaustion.watch(Resource.SANDBOX_DISK, self._disk_pressure)
        self.images = images
        self.state = state
        self.admission = admission
        self.ttl_interval = ttl_interval
        # Idle deadlines (monotonic, sandbox id), a heap: the reaper looks only at the
        # ones due, not at every sandbox every second. An entry may be early (activity
        # since moved the deadline): then it is put back at the real one. Never late:
        # activity only moves a deadline later, and every live sandbox with a TTL has one.
        self._idle: list[tuple[float, str]] = []
        self.stop_on_close = stop_on_close
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._stop_listeners: builtins.list[Callable[[str, str], None]] = []
        # called with the sandbox id when a paused sandbox runs again (dsec.rl.jobs.thaw)
        self.thaw_listeners: builtins.list[Callable[[str], None]] = []
        # awaited with the sandbox id once a sandbox is paused, before its memory is
        # reclaimed (dsec.rl.jobs), e.g. the data plane suspending its followers
        self.pause_listeners: builtins.list[Callable[[str], Awaitable[None]]] = []
        self.deaths = InitWatcher(self._init_died)  # a killed init fails its sandbox at once
        # A resumed sandbox may have a new init (a microVM restored into a new VMM).
        self.thaw_listeners.append(self._rewatch_init)
        admission.cost_mb = self._committed_memory_mb
        admission.on_refused = self.metrics.admission_refused
        self._death_tasks: set[asyncio.Task[None]] = set()
        self.clocks = IdleClocks(state)  # idle TTL deadlines that survive a restart
        self.keys = IdempotencyKeys(state)  # Idempotency-Key -> sandbox
        # trajectory log and replay (dsec.rl.trajectory), set by the platform; None: off
        self.trajectory: TrajectoryService | None = None
        self.jobs = JobControl(self, prefetch=resume_prefetch)  # pause/resume (dsec.rl.jobs)
        # Idle sandboxes give memory back, before admission refuses (dsec.edge.idle).
        self.idle = IdleReclaimer(
            self, idle_seconds=idle_reclaim_seconds, pressure_limit=reclaim_pressure
        )
        self.thaw_listeners.append(self.idle.track_id)
        # Sandboxes started before they are asked for (dsec.edge.warmpool).
        self.pool = WarmPool(
            per_shape=warm_per_shape,
            max_shapes=warm_shapes,
            idle_seconds=warm_idle_seconds,
            build=self._build_warm,
            discard=self._discard_warm,
            new_id=self.new_sandbox_id,
            can_refill=self._room_for_warm,
            generation=lambda: self.supervisor.generation,
            live=lambda: self.admission.count,
            grace_seconds=warm_grace_seconds,
        )
        # Teardowns that failed (e.g. out of fds) are tried again (dsec.edge.teardowns).
        self.teardowns = UnfinishedTeardowns(self._destroy_again, self._teardown_finished)

    # -- startup and shutdown -------------------------------------------------------------
    async def start(self) -> dict[str, list[str]]:
        """Recover from whatever the previous process left, then start the TTL reaper."""
        self.audit.start(self.supervisor)
        if isinstance(self.images, LayerCacheBudget):
            # The cache calls from any thread: the pool is the event loop's.
            event_loop = asyncio.get_running_loop()

            def let_go(layers: Mapping[str, int]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing is warm
                    event_loop.call_soon_threadsafe(self.pool.let_go, layers)

            self.images.on_layers_wanted(let_go)
        for backend in self.backends.values():
            await backend.start()
        report: dict[str, list[str]] = {"adopted": [], "cleaned": [], "lost": [], "swept": []}
        for rec in self.state.load(self.edge_id):
            self._records[rec.id] = rec
            runs = self.backends.get(rec.kind)
            if runs is None:  # kept as it is for an edge that runs its backend again
                if rec.state in LIVE_STATES:
                    log.warning("sandbox %s: no %s backend on this edge", rec.id, rec.kind.value)
                continue
            rec.facts = runs.load_facts(rec.facts.to_json())  # typed from here on
            if rec.state is SandboxState.PAUSED:  # stays frozen until a request/resume
                if await self.jobs.recover(rec):
                    if self.network is not None and rec.net is not None:
                        self.network.adopt(rec.id, rec.net, rec.spec.network_rules)
                    report["adopted"].append(rec.id)
                    continue
                self.jobs.release(rec)
                await self._finish(
                    rec, SandboxState.FAILED, "lost: the sandbox died while the edge was down"
                )
                report["lost"].append(rec.id)
                continue
            if rec.state is SandboxState.RUNNING:
                if await runs.is_alive(rec):
                    await runs.adopt(rec)
                    if self.network is not None and rec.net is not None:
                        self.network.adopt(rec.id, rec.net, rec.spec.network_rules)
                    report["adopted"].append(rec.id)
                    continue
                await self._finish(
                    rec, SandboxState.FAILED, "lost: the sandbox died while the edge was down"
                )
                report["lost"].append(rec.id)
            elif rec.state in (SandboxState.CREATING, SandboxState.STOPPING):
                was = rec.state
                final = (
                    SandboxState.FAILED if was is SandboxState.CREATING else SandboxState.STOPPED
                )
                reason = (
                    "edge restarted while the sandbox was being created"
                    if was is SandboxState.CREATING
                    else rec.reason
                )
                await self._finish(rec, final, reason)
                if was is SandboxState.CREATING:  # made no sandbox: a retry makes one
                    self.keys.forget_sandbox(rec.id)
                report["cleaned"].append(rec.id)
        # Idle clocks go on from where they were, not from "now" (dsec.edge.ttl).
        self.clocks.restore(r for r in self._records.values() if r.state is SandboxState.RUNNING)
        for rec in self._records.values():
            if rec.state in LIVE_STATES:
                self._arm_idle_ttl(rec)
        live = {r.id for r in self._records.values() if r.state in LIVE_STATES}
        for backend in self.backends.values():
            report["swept"] += await backend.sweep(live)
        if self.network is not None:  # rebuilds the rules of adopted sandboxes, sweeps the rest
            await self.network.start()
        self.admission.reset(r.spec for r in self._records.values() if r.state in LIVE_STATES)
        self.limits.start()
        for sid in report["adopted"]:  # once recovery is done: a death now fails it
            self._watch_init(self._records[sid])
            if self._records[sid].state is SandboxState.RUNNING:
                self.limits.watch(self._records[sid])
        self.supervisor.spawn("ttl-reaper", self._ttl_loop)
        for rec in self._records.values():
            if rec.state is SandboxState.RUNNING:
                self.idle.track(rec)
        self.supervisor.spawn("idle-reclaim", self.idle.loop)
        self.supervisor.spawn("warm-pool", self.pool.loop)
        self.supervisor.spawn("teardown-retry", self.teardowns.loop)
        network = self.network.supervised() if self.network is not None else []
        backends = list(self.backends.values())
        for name, healthy, restart in [*(s for b in backends for s in b.supervised()), *network]:
            self.supervisor.watch(name, healthy, restart)
        for name, loop in (entry for b in backends for entry in b.loops()):
            self.supervisor.spawn(name, loop)
        if any(report.values()):
            log.info("edge %s recovery: %s", self.edge_id, {k: len(v) for k, v in report.items()})
        return report

    async def close(self) -> None:
        await self.pool.close()  # warm sandboxes have no record: they never outlive us
        await self.limits.close()
        await self.supervisor.close()
        await self.deaths.close()
        # A death seen just before the close is torn down to the end: cut midway, it
        # would leave a STOPPING record and half its kernel objects for the next start.
        # Bounded: only a teardown stuck past its own timeouts is cancelled.
        if self._death_tasks:
            await asyncio.wait(list(self._death_tasks), timeout=DEATH_TEARDOWN_GRACE)
        for task in list(self._death_tasks):
            task.cancel()
        await asyncio.gather(*self._death_tasks, return_exceptions=True)
        # Exact idle deadlines for whatever outlives this process (dsec.edge.ttl).
        self.clocks.flush([r for r in self._records.values() if r.state is SandboxState.RUNNING])
        if self.stop_on_close:
            live = [r.id for r in self._records.values() if r.state in LIVE_STATES]
            await asyncio.gather(
                *(self.stop(sid, reason="platform shut down") for sid in live),
                return_exceptions=True,
            )
        # Teardowns that failed get their last tries while the backends are still open.
        for pause in (0.0, 0.2, 0.5):
            if not self.teardowns:
                break
            await asyncio.sleep(pause)
            await self.teardowns.retry()
        for backend in self.backends.values():
            await backend.close()
        if self.network is not None:
            # The table and veths stay only for sandboxes that run on to the next edge
            # process; with none live (all stopped, or none made) nothing is left behind.
            await self.network.close(keep_rules=not self.stop_on_close and self.sandboxes_live())
        self.state.close()
        await self.audit.close()

    def sandboxes_live(self) -> bool:
        """Whether any sandbox of this edge is live (after close: runs on past it)."""
        return any(r.state in LIVE_STATES for r in self._records.values())

    # -- lifecycle ------------------------------------------------------------------------
    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        return await self._create(spec, timeout=timeout, claim=None)

    def new_sandbox_id(self, spec: RunArgs | None = None) -> str:
        """A fresh id of this edge's form (``<edge id>-<16 hex>``): 128 random bits do
        not collide. With ``spec``: a warm sandbox's id when one of its shape is ready,
        held for the create_named that follows (dsec.edge.warmpool)."""
        if spec is not None and spec.backend in WARM_KINDS:
            held = self.pool.reserve(spec)
            if held is not None:
                return held
        return f"{self.edge_id}-{secrets.token_hex(8)}"

    def forget_sandbox_id(self, sandbox_id: str) -> None:
        self.pool.unreserve(sandbox_id)

    async def create_named(self, spec: RunArgs, *, timeout: float, sandbox_id: str) -> SandboxInfo:
        """``create`` under an id from new_sandbox_id, so that the caller could charge
        the quota under the final id before the create (dsec.apiserver.creator). A warm
        sandbox held under the id and not taken (the create failed first, e.g. a 422 or
        a refusal) stays held until the caller's forget_sandbox_id: the caller gives
        back its charge under the id first (see NamedCreates)."""
        if not sandbox_id.startswith(f"{self.edge_id}-") or sandbox_id in self._records:
            raise InvalidArgument(f"sandbox id {sandbox_id!r} is not a fresh id of this edge")
        return await self._create(spec, timeout=timeout, claim=None, sandbox_id=sandbox_id)

    async def replay(self, claim: IdempotencyClaim, *, timeout: float) -> SandboxInfo | None:
        """The sandbox an earlier create with ``claim``'s key made, whatever its state
        (waiting up to ``timeout`` for one still in flight); None: the key is unused.
        IdempotencyKeyReused (409) if the key went with another spec."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.keys.find(claim)
            if found is None:
                return None
            if isinstance(found, str):
                rec = self._records.get(found)
                if rec is not None:
                    return rec.info()
                self.keys.forget_sandbox(found)  # its record was forgotten: key is free
                return None
            try:
                await asyncio.wait_for(asyncio.shield(found), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise Timeout(
                    f"the create with this Idempotency-Key did not finish within {timeout:g}s; "
                    "retry with the same key",
                ) from None
            # Done (or failed, freeing the key): look again.

    async def create_keyed(
        self, spec: RunArgs, *, timeout: float, claim: IdempotencyClaim
    ) -> tuple[SandboxInfo, bool]:
        """Create at most once per key: (info, True) when this call made the sandbox,
        (info, False) when an earlier create with the key did. The create runs on even
        if the caller goes away, so that a retry with the key adopts it."""
        found = await self.replay(claim, timeout=timeout)
        if found is not None:
            return found, False
        # replay() found the key unused and returned without awaiting since: no other
        # create with it can have begun in between.
        self.keys.begin(claim)
        task = asyncio.ensure_future(self._create(spec, timeout=timeout, claim=claim))
        return await asyncio.shield(task), True

    async def _create(
        self,
        spec: RunArgs,
        *,
        timeout: float,
        claim: IdempotencyClaim | None,
        sandbox_id: str | None = None,
    ) -> SandboxInfo:
        if claim is None:
            return await self._build(spec, timeout=timeout, claim=None, sandbox_id=sandbox_id)
        made: str | None = None
        try:
            info = await self._build(spec, timeout=timeout, claim=claim)
            made = info.id
            return info
        finally:
            self.keys.end(claim, made)

    async def _build(
        self,
        spec: RunArgs,
        *,
        timeout: float,
        claim: IdempotencyClaim | None,
        sandbox_id: str | None = None,
    ) -> SandboxInfo:
        started = time.perf_counter()
        try:
            runnable = require_backend(spec)  # 501 for a kind without a backend, first
            self._check_exhaustion()  # 507/503 before any work while the host is out
            with self.exhaustion.mapped():
                info = await self._build_mapped(
                    runnable, timeout=timeout, claim=claim, sandbox_id=sandbox_id
                )
        except BaseException as exc:
            code = (
                exc.code
                if isinstance(exc, DSecError)
                else "cancelled"
                if isinstance(exc, asyncio.CancelledError)
                else "internal"
            )
            self.metrics.create_failed(str(spec.backend), code)
            raise
        self.metrics.created(str(spec.backend), time.perf_counter() - started)
        return info

    async def _build_warm(self, sid: str, spec: RunArgs, image: ImageInfo) -> BackendFacts:
        """Start a warm sandbox (dsec.edge.warmpool): the backend's create, nothing of
        the edge's (no record, no charge, no audit: nobody has it yet)."""
        backend = self.backend_for(BackendKind(spec.backend))
        return await backend.create(CreateInput(id=sid, spec=spec, image=image))

    async def _discard_warm(self, warm: Warm) -> None:
        """Tear a warm sandbox down through its backend's destroy, which works from a
        record: one made for it here, never stored (nobody had it)."""
        rec = self._new_record(warm.id, warm.spec, warm.image, SandboxState.STOPPING)
        rec.facts = warm.facts
        await self.backend_for(BackendKind(warm.spec.backend)).destroy(rec)

    def _new_record(
        self, sandbox_id: str, spec: RunArgs, image: ImageInfo, state: SandboxState
    ) -> SandboxRecord:
        """A record of this edge's, made now."""
        now = _now()
        return SandboxRecord(
            id=sandbox_id,
            spec=spec,
            image=image,
            state=state,
            created_at=now,
            updated_at=now,
            edge=self.edge_id,
        )

    def _room_for_warm(self) -> bool:
        """Warm sandboxes are started and handed out only while a create would be
        admitted without squeezing anyone and no backend decides anything from a
        shortage (a sandbox disk's guard clamping or refusing: dsec.resources.diskguard)."""
        try:
            self.exhaustion.check_create()
        except DSecError:
            return False
        if self.supervisor.failures():  # a component down: what it adds to a sandbox too
            return False
        if any(self.backends[k].disk_pressure() for k in WARM_KINDS if k in self.backends):
            return False
        use = self.admission.measure()
        return (
            not self.admission.shortfall(use)
            and self.admission.count < self.admission.max_sandboxes
        )

    def _check_exhaustion(self) -> None:
        """The host has run out of something (dsec.exhaustion): refused, and counted
        with admission's refusals (an operator sees one place for "why no creates")."""
        try:
            self.exhaustion.check_create()
        except DSecError:
            self.metrics.admission_refused("exhausted")
            raise

    def _gauges(self) -> Iterator[Metric]:
        """Sandboxes by state and backend, and what admission has committed."""
        counts: Counter[tuple[str, str]] = Counter(
            (rec.state.value, str(rec.spec.backend)) for rec in self._records.values()
        )
        yield gauge(
            "dsec_sandboxes",
            "Sandboxes this edge knows, by state and backend",
            ["state", "backend"],
            ((list(key), n) for key, n in sorted(counts.items())),
        )
        yield from self._job_gauges()
        a = self.admission
        yield gauge("dsec_admission_sandboxes", "Admitted sandboxes", [], [([], a.count)])
        yield gauge(
            "dsec_admission_capacity", "Sandboxes this edge admits", [], [([], a.max_sandboxes)]
        )
        yield gauge(
            "dsec_admission_memory_committed_mb", "Memory committed", [], [([], a.memory_mb)]
        )
        yield gauge(
            "dsec_admission_memory_budget_mb", "Memory budget", [], [([], a.memory_budget_mb)]
        )
        yield gauge(
            "dsec_admission_capacity_by",
            "Sandboxes each host resource allows (the smallest is the capacity)",
            ["resource"],
            [([name], n) for name, n in sorted(a.capacity.limits.items())],
        )
        yield gauge(
            "dsec_admission_cpu_committed_cores", "CPU limits admitted", [], [([], a.cpu_cores)]
        )
        pool = self.pool
        yield gauge(
            "dsec_warm_sandboxes",
            "Sandboxes started ahead of a create (dsec.edge.warmpool), ready or held",
            [],
            [([], pool.ready_count())],
        )
        yield counter("dsec_warm_hits", "Creates served by a warm sandbox", pool.hits)
        yield counter(
            "dsec_warm_misses", "Creates of a warm kind that started their own", pool.misses
        )
        idle = self.idle
        yield counter(
            "dsec_idle_reclaims",
            "Idle sandboxes whose memory was reclaimed (cold, pressure or make-room)",
            idle.reclaims,
        )
        yield counter(
            "dsec_idle_reclaimed_bytes", "Bytes idle reclaim gave back", idle.reclaimed_bytes
        )
        yield counter(
            "dsec_idle_pressure_reclaims",
            "Idle sandboxes pushed to swap under memory pressure or to make room",
            idle.pressure_reclaims,
        )

    def _job_gauges(self) -> Iterator[Metric]:
        """Per-job counts without a job label (a job id is the client's to choose, so
        it never becomes a label): how many jobs have live sandboxes, how many have
        paused ones, and the live sandboxes of the largest job."""
        live: Counter[str] = Counter(
            rec.spec.job_id
            for rec in self._records.values()
            if rec.spec.job_id is not None and rec.state in LIVE_STATES
        )
        paused = {
            rec.spec.job_id
            for rec in self._records.values()
            if rec.spec.job_id is not None and rec.state is SandboxState.PAUSED
        }
        yield gauge(
            "dsec_jobs",
            "Jobs (distinct job_id) with live sandboxes, and with paused ones",
            ["state"],
            [(["live"], len(live)), (["paused"], len(paused))],
        )
        yield gauge(
            "dsec_job_sandboxes_max",
            "Live sandboxes of the job that has the most",
            [],
            [([], max(live.values(), default=0))],
        )

    async def _build_mapped(
        self,
        spec: RunArgs,
        *,
        timeout: float,
        claim: IdempotencyClaim | None,
        sandbox_id: str | None,
    ) -> SandboxInfo:
        backend = self.backend_for(BackendKind(spec.backend))  # 501 for a kind not run here
        allowed = sorted(name for name, allow in spec.network_rules.items() if allow)
        if allowed:
            backend.require(Capability.NETWORK_RULES)
        if spec.protected:
            backend.require(Capability.PROTECTED_PATHS)
        if spec.disk_limit_mb is not None:
            backend.require(Capability.DISK_LIMIT)
        if spec.qos != "latency":  # latency is every backend's normal scheduling
            backend.require(Capability.QOS)
        if self.network is not None and spec.network_rules:
            self.network.check(spec.network_rules)  # a bad rule is a 422 before any work
        elif allowed:
            raise Unsupported(
                f"egress rules are not enforced yet (asked to allow {', '.join(allowed)}); "
                "omit them or set them to False: without rules a sandbox has only loopback",
                rules=allowed,
            )
        self.admission.check_limits(spec)
        backend.check_limits(spec)  # e.g. disk_limit_mb larger than the sandbox disk
        image = await self._image_of(spec)
        completed = backend.spec_for_image(spec, image)
        if completed.network_rules != spec.network_rules:  # e.g. a VM snapshot's saved rules
            if self.network is None:
                raise Unsupported(
                    f"image {spec.image_ref} needs a network (rules "
                    f"{sorted(completed.network_rules)}) and this edge enforces none"
                )
            self.network.check(completed.network_rules)
            spec = completed
        # Protected layers: resolved to digests now, like the image's (None: inline files).
        protected_layers = [
            (await self.images.layer_digest(m.layer))[0] if m.layer is not None else None
            for m in spec.protected
        ]
        # Inline answers go to the backend only, never to edge.db or an answer.
        inline = [dict(m.files) for m in spec.protected]
        if any(inline):
            spec = spec.model_copy(update={"protected": redact_files(spec.protected)})
        # A sandbox started ahead of this create, if one of its shape is ready; held
        # under sandbox_id when the caller named it with new_sandbox_id(spec).
        warm = self.pool.claim(sandbox_id) if sandbox_id is not None else None
        try:
            use = self.admission.measure()  # one reading for both, when nothing awaits between
            short = self.admission.shortfall(use)  # short of memory by use: idle ones first
            if short:
                self.pool.drain()  # warm sandboxes go before anyone's idle memory
                await self.idle.make_room(short)
                use = None  # stale after the wait: admit() reads again
            self.admission.admit(spec, use)
            if warm is None and sandbox_id is None and spec.backend in WARM_KINDS:
                warm = self.pool.take(spec)
            if warm is not None:  # its image's tags may have moved since: then not
                # (fits() has it from here: torn down, never given back, if it fails)
                candidate, warm = warm, None
                warm = await self.pool.fits(candidate, image)
        except BaseException:
            if warm is not None and sandbox_id is not None:
                self.pool.hold(warm)  # named: the caller's forget_sandbox_id frees it
            elif warm is not None:  # not used: free for the next create of its shape
                self.pool.give_back(warm)
            raise
        rec = self._new_record(
            sandbox_id or (warm.id if warm is not None else self.new_sandbox_id()),
            spec,
            image,
            SandboxState.CREATING,
        )
        # The sandbox lock is held until the create has settled: a stop of a CREATING
        # sandbox waits for it, and then tears down what the create really made. Torn
        # down meanwhile, it met facts that held nothing, and the create then stored
        # facts holding the image layers that nothing would release (a layer counted
        # as used at close, CI on b9eae9e and 1335cd2), and set RUNNING over STOPPED.
        async with self._lock(rec.id):
            self._records[rec.id] = rec
            self.audit.tag(rec.id, spec.job_id, spec.trajectory_id)
            self.audit.record(
                rec.id,
                AuditKind.LIFECYCLE,
                "create",
                image=spec.image_ref,
                layers=list(image.layers),
                network_rules=spec.network_rules,
                **({"protected": protected_summary(spec.protected)} if spec.protected else {}),
            )
            try:
                # The key is durable with the record, before anything is acknowledged.
                self.state.save(rec, key=None if claim is None else self.keys.row(claim, rec.id))
                if self.network is not None and spec.network_rules:
                    rec.net = await self.network.attach(
                        rec.id, spec.network_rules, vm=backend.network_device == "tap"
                    )
                inp = CreateInput(
                    id=rec.id,
                    spec=spec,
                    image=image,
                    protected_layers=tuple(protected_layers),
                    protected_files=tuple(inline),
                    net=rec.net,
                )
                if warm is not None:
                    rec.facts = warm.facts  # started ahead, never handed to anyone
                else:
                    # asyncio.timeout, not wait_for: no task of its own (two event-loop turns
                    # less on the create path); a timeout cancels the create just the same.
                    with self.pool.creating():
                        async with asyncio.timeout(timeout):
                            rec.facts = await backend.create(inp)
                if self.network is not None:
                    self.network.joined(rec.id)  # the sandbox holds its netns from now on
            except BaseException as exc:
                reason = (
                    f"creation did not finish within {timeout:g}s"
                    if isinstance(exc, TimeoutError)
                    else f"creation failed: {exc or type(exc).__name__}"
                )
                await asyncio.shield(self._finish(rec, SandboxState.FAILED, reason))
                if isinstance(exc, TimeoutError):
                    raise Timeout(reason, sandbox_id=rec.id) from None
                typed = self.exhaustion.typed(exc) if isinstance(exc, Exception) else None
                if typed is not None:  # the host ran out of something: say which, no traceback
                    typed.details["sandbox_id"] = rec.id
                    raise typed from None
                if isinstance(exc, DSecError):
                    raise
                if isinstance(exc, Exception):
                    raise BackendError(reason, sandbox_id=rec.id) from exc
                raise
            self._set(rec, SandboxState.RUNNING)
            self.limits.track(rec.id)
            self.limits.watch(rec)
            self.clocks.started(rec)
            self._arm_idle_ttl(rec)
            self.idle.track(rec)
            self._watch_init(rec)
            if spec.backend in WARM_KINDS:
                self.pool.asked(spec, image, hit=warm is not None)
            return rec.info()

    async def _image_of(self, spec: RunArgs) -> ImageInfo:
        """What a sandbox starts from: a container's or microVM's layered image (base +
        workspace + toolkit, resolved to digests now); a kind without layers is named
        only."""
        if isinstance(spec, DSecContainerRunArgs | DSecMicroVMRunArgs):
            return await self.images.compose(spec)
        if isinstance(spec, DSecFullVMRunArgs):  # its blobs: disk, kernel, initrd
            image = await self.images.resolve(spec.vm_image)
            VMImage.of(image.config, spec.vm_image)  # a 422 now if it is not a VM image
            return image
        return ImageInfo(
            name=spec.image_ref, tag="", digest="", layers=[], size_bytes=0, created_at=_now()
        )

    async def stop(self, sandbox_id: str, *, reason: str = "stopped by request") -> SandboxInfo:
        rec = self._get(sandbox_id)
        async with self._lock(sandbox_id):
            if rec.state.terminal:
                return rec.info()
            await self._finish(rec, SandboxState.STOPPED, reason)
        return rec.info()

    async def _finish(self, rec: SandboxRecord, final: SandboxState, reason: str | None) -> None:
        """Tear down and record the end; the teardown intent is durable before it starts."""
        self.deaths.forget(rec.id)  # we kill it now: not a death to report
        self.clocks.forget(rec.id)
        was_live = rec.state in LIVE_STATES
        self.jobs.release(rec)  # a paused sandbox is thawed first: SIGKILL needs that
        if rec.state is SandboxState.RUNNING:
            self.limits.check(rec)  # a last look: limits hit since the last scan
        self._set_best_effort(rec, SandboxState.STOPPING, reason)
        for listener in self._stop_listeners:  # before the kill: no command may seem to
            listener(rec.id, reason or final.value)  # exit on its own while it is torn down
        try:
            await self.backend_of(rec).destroy(rec)
        except DSecError as exc:
            log.error("teardown of %s incomplete (will retry): %s", rec.id, exc)
            final, reason = SandboxState.FAILED, f"{reason}; teardown incomplete: {exc}"
            self.teardowns.add(rec)
        self._set_best_effort(rec, final, reason)
        self.metrics.ended(str(rec.spec.backend), final.value)
        self.audit.record(rec.id, AuditKind.LIFECYCLE, final.value, reason=reason)
        self.tamper.forget(rec.id)
        self.detectors.forget(rec.id)
        self.limits.forget(rec.id)
        if self.network is not None:
            self.network.release(rec.id)
        if was_live:
            self.admission.release(rec.spec)

    async def _destroy_again(self, rec: SandboxRecord) -> None:
        async with self._lock(rec.id):
            await self.backend_of(rec).destroy(rec)

    def _teardown_finished(self, rec: SandboxRecord, attempts: int) -> None:
        """A teardown that failed succeeded on a later try: the record says so too (it
        stays failed: what ran in it was cut off the way its reason says)."""
        log.info("teardown of %s completed (try %d)", rec.id, attempts)
        self.audit.record(rec.id, AuditKind.LIFECYCLE, "teardown_completed", attempts=attempts)
        reason = f"{rec.reason or 'failed'}; teardown completed on try {attempts}"
        self._set_best_effort(rec, rec.state, reason)

    def _watch_init(self, rec: SandboxRecord) -> None:
        pid = rec.facts.init_pid
        if pid is not None:
            # A connection the backend holds to the init anyway saves a pidfd a sandbox.
            passive = self.backend_of(rec).watch_init_channel(rec, self.deaths.closed)
            self.deaths.watch(rec.id, pid, passive=passive)

    def _committed_memory_mb(self, spec: RunArgs) -> int:
        """Admission's charge for ``spec``: what its backend says it commits."""
        backend = self.backends.get(BackendKind(spec.backend))
        if backend is None:
            return spec.memory_limit_mb
        return backend.committed_memory_mb(spec, self.admission.memory_overcommit)

    def _rewatch_init(self, sandbox_id: str) -> None:
        rec = self._records.get(sandbox_id)
        if rec is not None:
            self._watch_init(rec)

    def _init_died(self, sandbox_id: str, pid: int, status: int | None) -> None:
        """A watched init exited (dsec.edge.deaths): the record says failed, and how."""
        task = asyncio.get_running_loop().create_task(self._fail_dead(sandbox_id, pid, status))
        self._death_tasks.add(task)
        task.add_done_callback(self._death_tasks.discard)

    async def _fail_dead(self, sandbox_id: str, pid: int, status: int | None) -> None:
        rec = self._records.get(sandbox_id)
        if rec is None:
            return
        try:
            async with self._lock(sandbox_id):
                if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                    return
                if rec.facts.init_pid != pid:
                    # Not its init any more: the backend ended it on purpose (a microVM
                    # paused to a snapshot) or replaced it (resumed into a new VMM).
                    return
                known = self.backend_of(rec).death_reason(rec)
                reason = known or f"the sandbox's init process died: {describe(status)}"
                log.warning("sandbox %s: %s", sandbox_id, reason)
                await self._finish(rec, SandboxState.FAILED, reason)
        except Exception:
            log.exception("failing %s after its init died", sandbox_id)

    def add_stop_listener(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(sandbox_id, reason)`` when a sandbox starts to end, before its
        processes are killed (the data path fails its sessions and commands)."""
        self._stop_listeners.append(listener)

    def _set_best_effort(self, rec: SandboxRecord, state: SandboxState, reason: str | None) -> None:
        """``_set`` for a teardown: a full disk must not stop it half-way. The record
        then keeps its last durable state, which recovery resolves after a restart
        (a "creating" or "stopping" row is cleaned up, a "running" one found dead)."""
        try:
            self._set(rec, state, reason)
        except Exception as exc:
            if self.exhaustion.typed(exc) is None:
                raise
            log.warning("sandbox %s: %s not recorded durably: %s", rec.id, state.value, exc)

    def _set(
        self,
        rec: SandboxRecord,
        state: SandboxState,
        reason: str | None = None,
        *,
        spec_changed: bool = False,
    ) -> None:
        rec.state = state
        if reason is not None:
            rec.reason = reason
        rec.updated_at = _now()
        if spec_changed:
            self.state.save(rec)
        else:
            self.state.save_state(rec)  # the spec and image were written at create

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        """Replace (not merge) a running sandbox's egress rules; applies to new
        connections at once, open ones go on (dsec.net.manager)."""
        rules = check_network_rules(dict(rules))
        async with self._lock(sandbox_id):
            rec = self.running_record(sandbox_id)
            self.backend_of(rec, Capability.NETWORK_RULES)
            if self.network is None:
                raise Unsupported("egress rules are not available on this edge")
            start = time.perf_counter()
            await self.network.update(sandbox_id, rules)
            old, rec.spec.network_rules = rec.spec.network_rules, dict(rules)
            self._set(rec, rec.state, spec_changed=True)
            self.audit.record(
                sandbox_id,
                AuditKind.LIFECYCLE,
                "network_update",
                old=old,
                new=rules,
                duration=round(time.perf_counter() - start, 6),
            )
        return NetworkRules(network_rules=rules)

    # -- backends -----------------------------------------------------------------------
    def backend_for(self, kind: BackendKind, capability: Capability | None = None) -> Backend:
        """The backend running ``kind`` sandboxes here; Unsupported (501) naming the
        kind when none is enabled, or naming backend and capability when it lacks
        ``capability``: before any work."""
        backend = self.backends.get(kind)
        if backend is None:
            why = self.unavailable.get(kind)
            raise Unsupported(
                f"this edge runs no {kind.value} sandboxes" + (f" ({why})" if why else ""),
                backend=kind.value,
            )
        if capability is not None:
            backend.require(capability)
        return backend

    def backend_of(self, rec: SandboxRecord, capability: Capability | None = None) -> Backend:
        """The backend of the sandbox ``rec`` (see ``backend_for``); the capability is
        the sandbox's own (``Backend.capabilities_of``)."""
        backend = self.backend_for(rec.kind)
        if capability is not None:
            backend.require_of(rec, capability)
        return backend

    def _disk_pressure(self) -> str | None:
        """The first backend's reason its writable disks are held short, if any."""
        return next((why for b in self.backends.values() if (why := b.disk_pressure())), None)

    def _limit_counters(self, rec: SandboxRecord) -> Any:
        """The limit watcher's probe: None for a sandbox no backend here runs."""
        backend = self.backends.get(rec.kind)
        return backend.limit_counters(rec) if backend is not None else None

    def _limit_cgroup(self, rec: SandboxRecord) -> str | None:
        """The cgroup whose notifications tell the limit watcher when to read ``rec``."""
        backend = self.backends.get(rec.kind)
        return backend.limit_cgroup(rec) if backend is not None else None

    # -- queries --------------------------------------------------------------------------
    def _get(self, sandbox_id: str) -> SandboxRecord:
        rec = self._records.get(sandbox_id) if SANDBOX_ID_RE.match(sandbox_id) else None
        if rec is None:
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r} on edge {self.edge_id}", sandbox_id=sandbox_id
            )
        return rec

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # -- the edge's port, for the RL job control and pack (dsec.rl): what they may do to
    # a sandbox, and nothing of the edge's internals ------------------------------------
    def record(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's record (SandboxNotFound if this edge has none)."""
        return self._get(sandbox_id)

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox's record, or None if this edge has none."""
        return self._records.get(sandbox_id)

    def records_in(self, states: set[SandboxState]) -> list[SandboxRecord]:
        """Every sandbox in one of ``states``, as they are now (dsec.edge.idle)."""
        return [r for r in list(self._records.values()) if r.state in states]

    def records_of_job(self, job_id: str, states: set[SandboxState]) -> list[SandboxRecord]:
        """The job's sandboxes in one of ``states``, as they are now."""
        return [
            r for r in list(self._records.values()) if r.spec.job_id == job_id and r.state in states
        ]

    def exclusive(self, sandbox_id: str) -> asyncio.Lock:
        """Held by every state change of the sandbox (create, stop, verify, pause):
        hold it to make one that must not interleave with those."""
        return self._lock(sandbox_id)

    def transition(self, rec: SandboxRecord, state: SandboxState) -> None:
        """Record a new state durably (edge.db) before returning; call it holding
        ``exclusive(rec.id)``, except for the transparent resume of a paused sandbox."""
        self._set(rec, state)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._get(sandbox_id).info()

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> list[SandboxInfo]:
        out = []
        for rec in self._records.values():
            if states is not None and rec.state not in states:
                continue
            if labels and any(rec.spec.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(rec.info())
        out.sort(key=lambda i: i.created_at)
        return out

    async def health(self) -> HealthInfo:
        degraded = [
            Degradation.model_validate(c.as_dict()) for c in self.exhaustion.conditions()
        ] + [Degradation.model_validate(f) for f in self.supervisor.failures()]
        return HealthInfo(
            status="degraded" if degraded else "ok",
            version=__version__,
            edge=self.edge_id,
            sandboxes_running=sum(
                1 for r in self._records.values() if r.state is SandboxState.RUNNING
            ),
            capacity=self.admission.max_sandboxes,
            admission=self.admission.capacity_report(),
            degraded=degraded,
            backends=[k.value for k in self.backends],
            backends_unavailable={k.value: why for k, why in self.unavailable.items()},
            backend_details={
                k.value: dict(d) for k, b in self.backends.items() if (d := b.details())
            },
        )

    # -- data path ------------------------------------------------------------------------
    async def _on_running(self, sandbox_id: str, op: Callable[[SandboxRecord], Awaitable[T]]) -> T:
        rec = self.running_record(sandbox_id)
        try:
            return await op(rec)
        except DSecError as exc:
            if not isinstance(exc, BackendError):
                raise
            backend = self.backend_of(rec)
            if rec.state is SandboxState.RUNNING and not await backend.still_running(rec):
                async with self._lock(sandbox_id):
                    if not rec.state.terminal:
                        reason = backend.death_reason(rec) or "the sandbox's init process died"
                        await self._finish(rec, SandboxState.FAILED, reason)
                raise SandboxNotRunning(f"sandbox {sandbox_id} died: {rec.reason}") from None
            raise
        except Exception as exc:
            # Host-side only (an agent's reply about the sandbox's own full disk is a
            # DSecError above): out of fds or memory on this side of the socket.
            typed = self.exhaustion.typed(exc)
            if typed is None:
                raise
            raise typed from None
        finally:
            self.clocks.touch(rec)

    def mark_active(self, sandbox_id: str) -> None:
        """``sandbox_id`` was used just now (its idle TTL starts over), e.g. by a data
        path stream; unknown ids are ignored."""
        rec = self._records.get(sandbox_id)
        if rec is not None:
            self.clocks.touch(rec)

    def running_record(self, sandbox_id: str) -> SandboxRecord:
        """The record of a running sandbox (marks it active), for the data path."""
        rec = self._get(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            self.jobs.thaw(rec, cause="request")  # transparent resume (dsec.rl.jobs)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {rec.state.value}"
                + (f": {rec.reason}" if rec.reason else ""),
                state=rec.state.value,
            )
        self.clocks.touch(rec)
        return rec

    async def call_running(self, sandbox_id: str, op: Callable[[SandboxRecord], Awaitable[T]]) -> T:
        """Run ``op`` on a running sandbox; a dead agent marks the sandbox failed."""
        return await self._on_running(sandbox_id, op)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        if req.trajectory is not None:  # logged and replayable: dsec.rl.trajectory decides
            if self.trajectory is None:
                raise Unsupported("this edge keeps no trajectory log")
            return await self.trajectory.exec(sandbox_id, req, req.trajectory)
        outcome: dict[str, object] = {"error": "did not finish"}
        started = time.perf_counter()
        try:
            res = await self._on_running(
                sandbox_id, lambda rec: self.backend_of(rec).exec(rec, req)
            )
            self.metrics.exec_done(
                str(self._records[sandbox_id].spec.backend), time.perf_counter() - started
            )
            outcome = _outcome(res)
            self.command_finished(sandbox_id)
            self.limits.after_exec(
                self._records[sandbox_id],
                exit_code=res.exit_code,
                timed_out=res.timed_out,
                truncated=res.truncated,
                command=req.command,
                max_output_bytes=req.max_output_bytes,
                timeout=req.timeout,
            )
            return res
        finally:
            self.audit.record(
                sandbox_id,
                AuditKind.COMMAND,
                "exec",
                command=req.command,
                user=req.user,
                workdir=req.workdir,
                **outcome,
            )

    async def stats(self, sandbox_id: str | None = None) -> builtins.list[SandboxStats]:
        """Resource use of every live sandbox, read from cgroups now (a few file reads
        each): what ``dsec top`` and the dashboard show. ``sandbox_id``: only that one
        (a sandbox's page polls it: its reads, not every sandbox's)."""
        now = time.monotonic()
        out: builtins.list[SandboxStats] = []
        if sandbox_id is None:
            recs = builtins.list(self._records.values())
        else:
            one = self._records.get(sandbox_id)
            recs = [one] if one is not None else []
        for rec in recs:
            if rec.state not in LIVE_STATES:
                continue
            backend = self.backends.get(rec.kind)
            raw = await backend.stats(rec) if backend is not None else {}
            out.append(
                SandboxStats(
                    id=rec.id,
                    backend=rec.kind,
                    state=rec.state,
                    image=rec.spec.image_ref,
                    job_id=rec.spec.job_id,
                    edge=rec.edge,
                    created_at=rec.created_at,
                    idle_seconds=max(0.0, now - rec.last_activity),
                    memory_bytes=raw.get("memory_bytes"),
                    cpu_seconds=raw.get("cpu_seconds"),
                    disk_bytes=raw.get("disk_bytes"),
                )
            )
        return out

    def helper_vm(
        self, backend: Backend, rec: SandboxRecord, what: str
    ) -> contextlib.AbstractContextManager[None]:
        """Admission of the helper VM a verify or pack step of ``rec`` starts, if its
        backend starts one (Backend.helper_vm_memory_mb), for the step's length."""
        memory = backend.helper_vm_memory_mb(rec.spec, self.admission.memory_overcommit)
        if memory is None:
            return contextlib.nullcontext()
        return self.admission.hold(memory, what)

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        """Run a grader in a pristine verifier that sees snapshots of the graded paths
        and the protected paths. Holds the sandbox's lock, so a stop waits for the
        verify to end. The detectors look at the sandbox once more first (a background
        process may have changed binaries since the last command). In ``fresh`` mode
        the sandbox is stopped by the step: it ends stopped, whatever the grader did."""
        outcome: dict[str, object] = {"error": "did not finish"}
        started, kind, result = time.perf_counter(), "", "internal"
        try:
            async with self._lock(sandbox_id):
                rec = self.running_record(sandbox_id)
                kind = str(rec.spec.backend)
                backend = self.backend_of(rec, Capability.VERIFY)
                try:  # bad input is refused before the sandbox is touched
                    req = req.model_copy(update={"graded": resolve_graded(rec.spec, req)})
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
                self.command_finished(sandbox_id)
                # A verifier VM is admitted before the sandbox is touched: refused, the
                # sandbox goes on as it was (a fresh step has not stopped it yet).
                with self.helper_vm(backend, rec, "verifier"):
                    if req.mode == "fresh":
                        self.deaths.forget(sandbox_id)  # the step ends its init: not a death
                    try:
                        res = await backend.verify(rec, req)
                    finally:
                        rec.last_activity = time.monotonic()
                        if req.mode == "fresh" and not rec.state.terminal:
                            await self._finish(
                                rec, SandboxState.STOPPED, "stopped by a fresh verify"
                            )
            outcome = {**_outcome(res), "passed": res.passed, "graded": res.graded}
            if res.refused:
                outcome["refused"] = len(res.refused)
            result = "passed" if res.passed else "failed"
            return res
        except DSecError as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            result = exc.code
            raise
        except asyncio.CancelledError:
            result = "cancelled"  # the caller went away (as a create's outcome)
            raise
        finally:
            if kind:  # (a verify of an unknown or stopped sandbox never started)
                self.metrics.verified(kind, time.perf_counter() - started, result)
            self.audit.record(
                sandbox_id,
                AuditKind.COMMAND,
                "verify",
                command=req.command,
                user=req.user,
                workdir=req.workdir,
                mode=req.mode,
                **outcome,
            )

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int) -> bytes:
        self.audit.record(sandbox_id, AuditKind.FILE, "read_file", path=path)
        return await self._on_running(
            sandbox_id,
            lambda rec: self.backend_of(rec, Capability.FILES).read_file(
                rec, path, max_bytes=max_bytes
            ),
        )

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        trajectory: TrajectoryRef | None = None,
    ) -> None:
        if trajectory is not None:  # logged and replayable: dsec.rl.trajectory decides
            if self.trajectory is None:
                raise Unsupported("this edge keeps no trajectory log")
            await self.trajectory.write_file(sandbox_id, path, data, mode, trajectory)
            return
        self.audit.record(sandbox_id, AuditKind.FILE, "write_file", path=path, size=len(data))
        await self._on_running(
            sandbox_id,
            lambda rec: self.backend_of(rec, Capability.FILES).write_file(
                rec, path, data, mode=mode
            ),
        )

    def command_finished(self, sandbox_id: str) -> None:
        """Run the after-command detectors (from outside the sandbox, on the host).

        Called after every exec, process and session command, and right before a
        verify freezes the agent (so a change made in the background since the last
        command is seen). Never raises: a detector that fails is on record as a
        ``detector_error`` event and the caller goes on to write its audit record."""
        rec = self._records.get(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            return  # gone or being torn down: its upper dir is no longer the sandbox's
        # A tamper scan that did not run is a gap a verdict may depend on: critical.
        self.detectors.run(
            "tamper", sandbox_id, lambda: self._scan_tampering(rec), severity=Severity.CRITICAL
        )

    def _scan_tampering(self, rec: SandboxRecord) -> None:
        upper = self.backend_of(rec).writable_dir(rec)
        if upper is None:
            return
        pid = rec.facts.init_pid  # its merged root says what /usr/local/bin shadows
        names = merged_names(Path(f"/proc/{pid}/root")) if pid is not None else None
        result = self.tamper.scan(rec.id, upper, system_names=names)
        if result.changes:
            self.audit.event(
                rec.id,
                EventKind.BINARY_TAMPERING,
                count=len(result.changes),
                changes=[f"{change} {path}" for path, change in result.changes[:MAX_REPORTED]],
            )
        if result.incomplete:  # fail closed: what was not looked at is on record
            first = result.incomplete[0]
            detail: dict[str, Any] = {
                "detector": "tamper",
                "reason": first.reason,
                "stopped_at": first.at,
                **first.detail,
            }
            if len(result.incomplete) > 1:
                detail["also"] = [f"{i.reason} {i.at}" for i in result.incomplete[1:]]
            self.audit.event(rec.id, EventKind.SCAN_INCOMPLETE, **detail)

    # -- idle TTL -------------------------------------------------------------------------
    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_interval)
            try:
                await self.reap_idle()
                self.keys.expire()
            except Exception:
                log.exception("TTL reaper pass failed")

    def _arm_idle_ttl(self, rec: SandboxRecord, at: float | None = None) -> None:
        """Put ``rec``'s idle deadline (or ``at``) on the reaper's heap."""
        ttl = rec.spec.ttl_running_stop
        if ttl is not None:
            heapq.heappush(self._idle, (rec.last_activity + ttl if at is None else at, rec.id))

    async def reap_idle(self) -> builtins.list[str]:
        """Stop the running sandboxes idle for longer than their TTL: O(due) per pass,
        not O(sandboxes) (at 10,000 sandboxes the old scan of every record each second
        was the edge's own O(N) periodic work)."""
        now = time.monotonic()
        expired: list[SandboxRecord] = []
        while self._idle and self._idle[0][0] <= now:
            _due, sid = heapq.heappop(self._idle)
            rec = self._records.get(sid)
            if rec is None or rec.state.terminal or rec.spec.ttl_running_stop is None:
                continue  # gone: its entry goes with it
            ttl = rec.spec.ttl_running_stop
            if rec.state is SandboxState.RUNNING and now - rec.last_activity > ttl:
                expired.append(rec)
            elif rec.state is SandboxState.RUNNING:
                # Used since: its real deadline (never now again, so the loop ends).
                self._arm_idle_ttl(rec, max(rec.last_activity + ttl, now + 0.001))
            else:  # paused or in a transition: a resume restarts its clock; look again
                self._arm_idle_ttl(rec, now + ttl)
        await asyncio.gather(
            *(
                self.stop(
                    rec.id,
                    reason=f"idle for more than {rec.spec.ttl_running_stop}s (ttl_running_stop)",
                )
                for rec in expired
            ),
            return_exceptions=True,
        )
        for rec in expired:
            if not rec.state.terminal:  # the stop failed: try again on the next pass
                self._arm_idle_ttl(rec, now + self.ttl_interval)
        return [rec.id for rec in expired]

    # -- RL co-design (dsec.rl) -----------------------------------------------------------
    async def pause_job(self, job_id: str) -> JobPauseReport:
        """Freeze every running sandbox of the job and reclaim its memory."""
        return await self.jobs.pause_job(job_id)

    async def resume_job(self, job_id: str) -> JobResumeReport:
        return await self.jobs.resume_job(job_id)

    async def pack_diff(self, sandbox_id: str, name: str, version: str) -> PackedEnv:
        """The sandbox's changes as a new layer ``name:version`` (dsec.rl.pack)."""
        return await pack_sandbox(self, sandbox_id, name, version)

    async def fork(self, sandbox_id: str, req: ForkRequest) -> ForkResult:
        return await fork_sandbox(self, sandbox_id, req)
