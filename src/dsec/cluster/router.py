"""The apiserver's edge in cluster mode: one EdgeAPI over every edge of the cluster.

Requests about an existing sandbox go to the edge its id names (``e3-...``), with no
lookup. A create is placed (dsec.control.placement) over the view that the edges'
heartbeats keep in the database, refreshed every ``refresh`` seconds; an edge that
refuses (it is full: the edge has the last word) or cannot be reached is skipped and
the next candidate tried; when no edge can take it the caller gets ``ClusterFull``
with the figures, never a timeout. Sandboxes of an edge that is down are answered
from the directory as ``lost``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from dsec.api.cluster import EdgeStatus
from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.health import HealthInfo
from dsec.api.rl import ForkRequest, ForkResult, JobPauseReport, JobResumeReport, PackedEnv
from dsec.api.sandbox import (
    IDEMPOTENCY_HEADER,
    DataPathInfo,
    NetworkRules,
    SandboxInfo,
    SandboxState,
    SandboxStats,
)
from dsec.api.spec import RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.cluster.keys import KeyPin
from dsec.cluster.registry import DOWN, LIVE, Registry, sandbox_info
from dsec.cluster.remote import RemoteEdge
from dsec.control.placement import Demand, EdgeLoad, EdgeView, Placer
from dsec.edge.idempotency import IdempotencyClaim
from dsec.edge.tokens import Scope
from dsec.errors import (
    AdmissionRejected,
    ClusterFull,
    DSecError,
    EdgeUnavailable,
    ImageNotFound,
    SandboxNotFound,
    SandboxNotRunning,
)
from dsec.observe.metrics import GaugeCollector, Metric, Metrics, gauge, host_gauges

log = logging.getLogger(__name__)
_STATS = TypeAdapter(list[SandboxStats])
_Report = TypeVar("_Report", JobPauseReport, JobResumeReport)
T = TypeVar("T")
# What an edge answers to a create: the sandbox, its usage, made by this call.
_Sent = tuple[SandboxInfo, "EdgeLoad | None", bool]


class _PinnedElsewhere(Exception):
    """Another apiserver pinned the key to another edge first (dsec.cluster.keys)."""

    def __init__(self, pin: KeyPin) -> None:
        super().__init__(pin.edge_id)
        self.pin = pin


CLUSTER_EDGE_ID = "cluster"
# A view older than this is not placed on, even before the watcher marks the edge down.
STALE_AFTER_S = 5.0
MISS_REFRESH_S = 0.2


def image_key(image: str) -> str:
    """How an image appears among an edge's cached layers in the placement view."""
    return "image:" + (image if ":" in image.rsplit("/", 1)[-1] else image + ":latest")


def edge_of(sandbox_id: str) -> str:
    return sandbox_id.split("-", 1)[0]


def view_of(status: EdgeStatus, now: float) -> EdgeView:
    r = status.report
    return EdgeView(
        edge_id=status.edge_id,
        url=status.url,
        up=status.status != DOWN and now - status.heartbeat_at < STALE_AFTER_S,
        capacity=r.capacity,
        sandboxes=r.sandboxes,
        cpu_cores=r.cpu_cores,
        cpu_committed=r.cpu_committed,
        memory_mb=r.memory_mb,
        memory_committed_mb=r.memory_committed_mb,
        backends=frozenset(r.backends),
        labels=dict(r.labels),
        layers=frozenset(r.layers) | frozenset(image_key(i) for i in r.images),
        seen_at=status.heartbeat_at,
        lazy=r.lazy,
        seq=r.load_seq,
    )


class ClusterEdge:
    edge_id = CLUSTER_EDGE_ID

    def __init__(
        self,
        registry: Registry,
        token: str,
        placer: Placer | None = None,
        *,
        version: str = "0",
        refresh: float = 0.25,
        rounds: int = 3,
    ) -> None:
        self.registry = registry
        # k=8 with the per-apiserver share guard and the edges' piggybacked usage:
        # closest to an omniscient least-loaded without its herd rejections
        # (bench/bench_placement.py, dsec.control.placement)
        self.placer = placer or Placer(k=8)
        self._token = token
        self._version = version
        self._refresh_period = refresh
        self._rounds = rounds
        self._edges: dict[str, EdgeStatus] = {}
        self._remotes: dict[str, RemoteEdge] = {}
        self._task: asyncio.Task[None] | None = None
        self._miss_refresh = 0.0
        # This apiserver's Prometheus metrics (its /metrics): creates it placed, and the
        # cluster as its view sees it; each edge serves its own sandboxes' metrics.
        self.metrics = Metrics.from_env()
        self.metrics.add(GaugeCollector(self._gauges))
        self.metrics.add(GaugeCollector(host_gauges))

    def _gauges(self) -> Iterator[Metric]:
        states = Counter(s.status for s in self._edges.values())
        yield gauge(
            "dsec_cluster_edges",
            "Edges in this apiserver's view, by status",
            ["status"],
            (([str(k)], float(n)) for k, n in sorted(states.items())),
        )
        ups = [s for s in self._edges.values() if s.status != DOWN]
        running = sum(s.report.sandboxes for s in ups)
        capacity = sum(s.report.capacity for s in ups)
        yield gauge("dsec_cluster_sandboxes_running", "Sum of edges' reports", [], [([], running)])
        yield gauge("dsec_cluster_capacity", "Sum of edges' capacity", [], [([], capacity)])

    # -- the view -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop(), name="dsec-cluster-view")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for remote in self._remotes.values():
            await remote.close()
        self._remotes.clear()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_period)
            try:
                await self.refresh()
            except Exception:  # the database may blink; the last view stays in use
                log.exception("cluster view refresh failed")

    async def refresh(self) -> None:
        statuses = await self.registry.edges()
        now = time.time()
        self._edges = {s.edge_id: s for s in statuses}
        for status in statuses:
            remote = self._remotes.get(status.edge_id)
            if remote is None or remote.url != status.url.rstrip("/"):
                if remote is not None:
                    await remote.close()
                self._remotes[status.edge_id] = RemoteEdge(status.edge_id, status.url, self._token)
        self.placer.update(view_of(s, now) for s in statuses)

    def known_edges(self) -> set[str]:
        return set(self._edges)

    def members(self) -> list[tuple[EdgeStatus, RemoteEdge | None]]:
        """Every edge of the view with its client (None until the view has one), by id:
        for the apiserver's fan-outs (dsec.cluster.fanout, dsec.cluster.fncall)."""
        return [(s, self._remotes.get(e)) for e, s in sorted(self._edges.items())]

    def edge_status(self, edge_id: str) -> EdgeStatus | None:
        return self._edges.get(edge_id)

    async def status_of(self, sandbox_id: str) -> tuple[EdgeStatus, RemoteEdge | None]:
        """The edge named by ``sandbox_id`` (SandboxNotFound if none), as fresh as a
        down edge needs, and its client."""
        status = await self._status(sandbox_id)
        return status, self._remotes.get(status.edge_id)

    async def remote_of(self, sandbox_id: str) -> RemoteEdge:
        """The live edge holding ``sandbox_id``; a down edge's sandbox is not running."""
        return await self._remote(sandbox_id)

    async def _status(self, sandbox_id: str) -> EdgeStatus:
        edge_id = edge_of(sandbox_id)
        status = self._edges.get(edge_id)
        if status is None and time.monotonic() - self._miss_refresh > MISS_REFRESH_S:
            # An edge that joined since the last refresh; at most so often, so that a
            # flood of made-up ids cannot turn into a flood of database reads.
            self._miss_refresh = time.monotonic()
            await self.refresh()
            status = self._edges.get(edge_id)
        if status is None:
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r}: no edge {edge_id!r} in this cluster",
                sandbox_id=sandbox_id,
            )
        if status.status == DOWN:
            # The view may be older than the edge's return: ask for this one row, so
            # that a sandbox the directory re-adopted is never answered as lost.
            fresh = await self.registry.edge(edge_id)
            if fresh is not None:
                self._edges[edge_id] = status = fresh
        return status

    async def _remote(self, sandbox_id: str) -> RemoteEdge:
        """The live edge holding ``sandbox_id``; a down edge's sandbox is not running."""
        status = await self._status(sandbox_id)
        if status.status == DOWN:
            info = await self._directory(sandbox_id)
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {info.state.value}: {info.reason}",
                sandbox_id=sandbox_id,
                state=info.state.value,
            )
        return self._remotes[status.edge_id]

    async def _directory(self, sandbox_id: str) -> SandboxInfo:
        row = await self.registry.sandbox(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        return sandbox_info(row)

    # -- create ---------------------------------------------------------------------------
    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        async def send(remote: RemoteEdge) -> _Sent:
            info, load = await remote.create_load(spec, timeout=timeout)
            return info, load, True

        return (await self._place(spec, send))[0]

    async def replay(self, claim: IdempotencyClaim, *, timeout: float) -> SandboxInfo | None:
        """The sandbox the key already made, when the cluster knows it; None otherwise
        (then ``create_keyed`` sends the create where the key is pinned, if anywhere)."""
        pin = await self.registry.keys.find(claim)
        if pin is None or pin.sandbox_id is None:
            return None
        return await self.get(pin.sandbox_id)

    async def create_keyed(
        self, spec: RunArgs, *, timeout: float, claim: IdempotencyClaim
    ) -> tuple[SandboxInfo, bool]:
        """At most one sandbox per key across every apiserver (dsec.cluster.keys)."""
        keys = self.registry.keys

        async def send(remote: RemoteEdge) -> _Sent:
            pin = await keys.pin(claim, remote.edge_id)
            if pin.edge_id != remote.edge_id:
                raise _PinnedElsewhere(pin)
            return await self._send_pinned(remote, pin, spec, timeout)

        for _ in range(self._rounds):
            pin = await keys.find(claim)
            if pin is not None:
                got = await self._to_pin(pin, spec, timeout)
                if got is not None:
                    return got
                continue  # the pin was given back: place anew
            try:
                return await self._place(spec, send)
            except _PinnedElsewhere:
                continue  # another apiserver pinned the key first: follow its pin
        raise EdgeUnavailable(
            f"the create with {IDEMPOTENCY_HEADER} {claim.key!r} could not be placed "
            "(its edge kept refusing or going away); retry with the same key",
        )

    async def _send_pinned(
        self, remote: RemoteEdge, pin: KeyPin, spec: RunArgs, timeout: float
    ) -> _Sent:
        """The keyed create on the pinned edge. An edge that refused made nothing, so
        the pin goes back; one that did not answer keeps it (it may have made it)."""
        try:
            info, load, made = await remote.create_keyed_load(spec, timeout=timeout, key=pin.key_id)
        except (AdmissionRejected, ImageNotFound):
            await asyncio.shield(self.registry.keys.unpin(pin))
            raise
        await self.registry.keys.bind(pin, info.id)
        return info, load, made

    async def _to_pin(
        self, pin: KeyPin, spec: RunArgs, timeout: float
    ) -> tuple[SandboxInfo, bool] | None:
        """Follow an existing pin; None when it was given back and the create must be
        placed anew (its edge refused, or is down with nothing recorded for the key)."""
        if pin.sandbox_id is not None:
            return await self.get(pin.sandbox_id), False
        status = self._edges.get(pin.edge_id) or await self.registry.edge(pin.edge_id)
        remote = self._remotes.get(pin.edge_id)
        if status is None or status.status == DOWN or remote is None:
            # Whatever that edge made for the key is unknown to the directory: it is
            # stopped as an orphan when the edge returns (dsec.cluster.registry).
            await self.registry.keys.unpin(pin)
            return None
        demand = self._demand(spec)
        self.placer.reserve(pin.edge_id, demand)
        try:
            info, load, made = await self._send_pinned(remote, pin, spec, timeout)
        except (AdmissionRejected, ImageNotFound):
            self.placer.unreserve(pin.edge_id, demand)
            return None
        except BaseException:
            self.placer.unreserve(pin.edge_id, demand)
            raise
        self.placer.confirm(pin.edge_id, demand, load)
        await self._record(info, remote)
        return info, made

    def _demand(self, spec: RunArgs) -> Demand:
        image = frozenset({image_key(spec.image_ref)})
        return Demand.for_spec(spec, spec.backend, layers=image, requires=image)

    async def _place(
        self, spec: RunArgs, send: Callable[[RemoteEdge], Awaitable[_Sent]]
    ) -> tuple[SandboxInfo, bool]:
        """``_place_once``, counted in this apiserver's metrics by outcome."""
        started = time.perf_counter()
        try:
            placed = await self._place_once(spec, send)
        except DSecError as exc:
            self.metrics.create_failed(str(spec.backend), exc.code)
            raise
        except Exception:
            self.metrics.create_failed(str(spec.backend), "internal")
            raise
        self.metrics.created(str(spec.backend), time.perf_counter() - started)
        return placed

    async def _place_once(
        self, spec: RunArgs, send: Callable[[RemoteEdge], Awaitable[_Sent]]
    ) -> tuple[SandboxInfo, bool]:
        """``send`` the create to the best candidates in turn until one takes it."""
        demand = self._demand(spec)
        tried: set[str] = set()
        refusals: list[dict[str, Any]] = []
        no_image: ImageNotFound | None = None
        for _ in range(self._rounds):
            candidates = [c for c in self.placer.candidates(demand, n=3) if c.edge_id not in tried]
            if not candidates:
                break
            for view in candidates:
                tried.add(view.edge_id)
                remote = self._remotes.get(view.edge_id)
                if remote is None:
                    continue
                self.placer.reserve(view.edge_id, demand)
                try:
                    info, load, made = await send(remote)
                except AdmissionRejected as exc:
                    self.placer.unreserve(view.edge_id, demand)
                    self.placer.refused(view.edge_id, exc.details)
                    refusals.append({"edge": view.edge_id, "code": exc.code, "reason": exc.message})
                    continue
                except (EdgeUnavailable, ImageNotFound) as exc:
                    # Unreachable, or it died mid-request: were it to come back with the
                    # sandbox, it stops it (no directory entry; dsec.cluster.registry).
                    self.placer.unreserve(view.edge_id, demand)
                    if isinstance(exc, ImageNotFound):
                        no_image = no_image or exc
                    refusals.append({"edge": view.edge_id, "code": exc.code, "reason": exc.message})
                    continue
                except BaseException:
                    self.placer.unreserve(view.edge_id, demand)
                    raise
                # the edge's usage from its answer: the other apiservers' creates there
                self.placer.confirm(view.edge_id, demand, load)
                await self._record(info, remote)
                return info, made
        if no_image is not None and all(r["code"] == no_image.code for r in refusals):
            raise no_image  # no edge tried has it: not a capacity problem
        ups = [s for s in self._edges.values() if s.status != DOWN]
        raise ClusterFull(
            f"no edge could take the sandbox ({len(tried)} tried, "
            f"{len(ups)} of {len(self._edges)} edges up); retry later",
            edges=len(self._edges),
            edges_up=len(ups),
            capacity=sum(s.report.capacity for s in ups),
            sandboxes=sum(s.report.sandboxes for s in ups),
            refusals=refusals[:20],
        )

    async def _record(self, info: SandboxInfo, remote: RemoteEdge) -> None:
        """Enter the sandbox in the directory; a sandbox that cannot be recorded is not
        kept (it would run unaccounted)."""
        try:
            await self.registry.created(info)
        except BaseException:
            with contextlib.suppress(DSecError):
                await remote.stop(info.id, reason="could not be recorded in the cluster")
            raise

    # -- one sandbox ----------------------------------------------------------------------
    async def get(self, sandbox_id: str) -> SandboxInfo:
        status = await self._status(sandbox_id)
        if status.status == DOWN:
            return await self._directory(sandbox_id)
        try:
            return await self._remotes[status.edge_id].get(sandbox_id)
        except SandboxNotFound:
            return await self._directory(sandbox_id)  # ended long ago: the directory knows
        except EdgeUnavailable as exc:
            # Not (yet) marked down by the watcher: the last known state, and why.
            info = await self._directory(sandbox_id)
            info.reason = f"last known state: edge {status.edge_id} did not answer ({exc})"
            return info

    async def stop(self, sandbox_id: str, *, reason: str = "stopped by request") -> SandboxInfo:
        status = await self._status(sandbox_id)
        if status.status == DOWN:
            note = f"{reason} while edge {status.edge_id} was down (stopped when it returns)"
            await self.registry.ended(sandbox_id, note)
            return await self._directory(sandbox_id)
        info, load = await self._remotes[status.edge_id].stop_load(sandbox_id, reason=reason)
        # A slot this apiserver saw free up, before the edge's next report says so.
        self.placer.released(status.edge_id, Demand.for_spec(info.spec, info.spec.backend), load)
        await self.registry.ended(sandbox_id, info.reason or reason)
        return info

    async def _on_edge(self, sandbox_id: str, op: Callable[[RemoteEdge], Awaitable[T]]) -> T:
        """``op`` on the sandbox's edge. An edge that does not answer, for a sandbox the
        directory already has lost or ended (the watcher was quicker than our view),
        is ``SandboxNotRunning`` with the reason, like a down edge."""
        remote = await self._remote(sandbox_id)
        try:
            return await op(remote)
        except EdgeUnavailable:
            row = await self.registry.sandbox(sandbox_id)
            if row is None or row.state == LIVE:
                raise
            info = sandbox_info(row)
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {info.state.value}: {info.reason}",
                sandbox_id=sandbox_id,
                state=info.state.value,
            ) from None

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self._on_edge(sandbox_id, lambda r: r.exec(sandbox_id, req))

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        return await self._on_edge(sandbox_id, lambda r: r.verify(sandbox_id, req))

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int) -> bytes:
        return await self._on_edge(
            sandbox_id, lambda r: r.read_file(sandbox_id, path, max_bytes=max_bytes)
        )

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """dsec.apiserver.filestreams.FileStreams: memory per request is one chunk."""
        return await self._on_edge(sandbox_id, lambda r: r.read_stream(sandbox_id, path))

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int
    ) -> int:
        return await self._on_edge(
            sandbox_id, lambda r: r.write_stream(sandbox_id, path, chunks, mode=mode)
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
        await self._on_edge(
            sandbox_id,
            lambda r: r.write_file(sandbox_id, path, data, mode=mode, trajectory=trajectory),
        )

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        return await self._on_edge(sandbox_id, lambda r: r.update_network(sandbox_id, rules))

    async def data_path(self, sandbox_id: str, *, scope: Scope = "full") -> DataPathInfo:
        """The edge's own URL and a token it minted: the data path bypasses us."""
        return await self._on_edge(sandbox_id, lambda r: r.data_path(sandbox_id, scope=scope))

    async def forward_to(
        self, sandbox_id: str, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        """Any route of the sandbox's edge (dsec.apiserver.relay.EdgeRelay), with the
        cluster token and the edge's typed errors."""
        return await self._on_edge(sandbox_id, lambda r: r.forward(method, path, **kwargs))

    async def relay(
        self,
        sandbox_id: str,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        params: builtins.list[tuple[str, str]],
        content: AsyncIterable[bytes] | None,
    ) -> httpx.Response:
        """A caller's request to the sandbox's edge, streamed both ways (RemoteEdge.relay)."""
        return await self._on_edge(
            sandbox_id,
            lambda r: r.relay(method, path, headers=headers, params=params, content=content),
        )

    # -- many sandboxes -------------------------------------------------------------------
    def _up(self) -> builtins.list[RemoteEdge]:
        return [self._remotes[e] for e, s in self._edges.items() if s.status != DOWN]

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Every edge's answer; an edge that does not answer is reported from the
        directory (with the reason), and ``lost`` sandboxes come from the directory."""
        remotes = self._up()
        answers = await asyncio.gather(
            *(r.list(labels=labels, states=states) for r in remotes), return_exceptions=True
        )
        out: builtins.list[SandboxInfo] = []
        known: builtins.list[SandboxInfo] = []
        for remote, answer in zip(remotes, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, DSecError):
                    raise answer
                log.warning("edge %s did not list: %s", remote.edge_id, answer)
                for info in await self.registry.live_on(remote.edge_id):
                    info.reason = f"last known state: edge {remote.edge_id} did not answer"
                    known.append(info)
                continue
            out.extend(answer)
        if states is None or SandboxState.LOST in states:
            known += await self.registry.lost()
        out += [
            info
            for info in known
            if (states is None or info.state in states)
            and all(info.labels.get(k) == v for k, v in (labels or {}).items())
        ]
        return out

    async def stats(self, sandbox_id: str | None = None) -> builtins.list[SandboxStats]:
        """Every edge's ``/v1/stats``, merged; an edge that does not answer is left out
        (its rows come back with it: this is a live view, not a record). With
        ``sandbox_id`` every edge is asked for that one only."""
        remotes = self._up()
        path = "/v1/stats" if sandbox_id is None else f"/v1/stats?sandbox_id={quote(sandbox_id)}"
        answers = await asyncio.gather(
            *(r.forward("GET", path) for r in remotes), return_exceptions=True
        )
        out: builtins.list[SandboxStats] = []
        for remote, answer in zip(remotes, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("edge %s did not answer /v1/stats: %s", remote.edge_id, answer)
                continue
            out.extend(_STATS.validate_json(answer.content))
        return out

    async def health(self) -> HealthInfo:
        ups = [s for s in self._edges.values() if s.status != DOWN]
        return HealthInfo(
            version=self._version,
            edge=CLUSTER_EDGE_ID,
            sandboxes_running=sum(s.report.sandboxes for s in ups),
            capacity=sum(s.report.capacity for s in ups),
        )

    async def pause_job(self, job_id: str) -> JobPauseReport:
        start = time.perf_counter()
        reports = await self._fan_out("POST", f"/v1/jobs/{job_id}/pause", JobPauseReport)
        merged = JobPauseReport(
            job_id=job_id,
            paused=sum(r.paused for r in reports),
            already_paused=sum(r.already_paused for r in reports),
            failed=sum(r.failed for r in reports),
            memory_reclaimed_bytes=sum(r.memory_reclaimed_bytes for r in reports),
            memory_before_bytes=sum(r.memory_before_bytes for r in reports),
            duration=time.perf_counter() - start,
            swap_available=any(r.swap_available for r in reports),
            sandboxes=[s for r in reports for s in r.sandboxes],
        )
        return merged

    async def resume_job(self, job_id: str) -> JobResumeReport:
        start = time.perf_counter()
        reports = await self._fan_out("POST", f"/v1/jobs/{job_id}/resume", JobResumeReport)
        return JobResumeReport(
            job_id=job_id,
            resumed=sum(r.resumed for r in reports),
            duration=time.perf_counter() - start,
            sandbox_ids=[i for r in reports for i in r.sandbox_ids],
        )

    async def pack_diff(self, sandbox_id: str, name: str, version: str) -> PackedEnv:
        remote = await self._remote(sandbox_id)
        body = {"name": name, "version": version}
        resp = await remote.forward("POST", f"/v1/sandboxes/{sandbox_id}/pack", json=body)
        return PackedEnv.model_validate_json(resp.content)

    async def fork(self, sandbox_id: str, req: ForkRequest) -> ForkResult:
        """On the source's edge (its layer is there); the children join the directory."""
        remote = await self._remote(sandbox_id)
        path = f"/v1/sandboxes/{sandbox_id}/fork"
        body = req.model_dump(mode="json", exclude_unset=True)
        resp = await remote.forward("POST", path, json=body, timeout=req.timeout * req.n + 60)
        result = ForkResult.model_validate_json(resp.content)
        for child in result.children:
            await self._record(child, remote)
        return result

    async def _fan_out(
        self, method: str, path: str, model: type[_Report]
    ) -> builtins.list[_Report]:
        remotes = self._up()
        answers = await asyncio.gather(
            *(r.forward(method, path) for r in remotes), return_exceptions=True
        )
        out: builtins.list[_Report] = []
        for remote, answer in zip(remotes, answers, strict=True):
            if isinstance(answer, BaseException):
                raise EdgeUnavailable(
                    f"edge {remote.edge_id} did not answer {path}: {answer}", edge=remote.edge_id
                )
            out.append(model.model_validate_json(answer.content))
        return out
