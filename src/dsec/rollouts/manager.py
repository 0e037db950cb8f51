"""Hosted rollouts: one worker per rollout on the edge, the gateway, the hand-off.

A worker takes a rollout through its states, each written to ``rollouts.db`` before it
is acted on, so that an edge restarted after a SIGKILL picks every live rollout up where
it was:

* ``starting``: the agent sandbox is created with the rollout's id as Idempotency-Key
  (a restart that finds the create done adopts the sandbox, never makes a second), the
  files are written as trajectory steps (a restart re-sends them and the log answers
  the ones already written), the scaffold is started as a background process that the
  sandbox's agent (the platform's, not the scaffold's) owns and keeps the exit status
  of. A restart that finds a background process in the sandbox adopts it instead of
  starting the scaffold again: the agent sandbox runs nothing else in the background.
* ``running`` / ``waiting_for_model`` / ``paused``: the worker waits for the scaffold's
  exit, which the data plane re-attaches to after a restart (live restore); the model
  gateway moves the rollout between these three.
* ``rewarding``: the reward step (a verify step: a pristine grader that sees the agent's
  files as data; its exit status decides, never anything the agent wrote) runs once;
  a restart in the middle of it fails the rollout rather than grading twice.
* ``finished`` / ``failed`` / ``cancelled``: the agent sandbox is stopped; the rollout
  waits in the job's hand-off list until the trainer acknowledges it.

Paused rollouts with no call in flight (e.g. after a restart, which dropped the held
call's connection) are thawed by a loop that probes the job's endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any

import httpx

from dsec.api.events import AuditKind
from dsec.api.exec import CommandArgs
from dsec.api.fncall import JudgeRequest
from dsec.api.rollouts import (
    MAX_JUDGED_BYTES,
    TERMINAL,
    AckResult,
    EndpointSet,
    FnCallJudge,
    ModelEndpoint,
    RolloutInfo,
    RolloutResult,
    RolloutSpec,
    RolloutState,
)
from dsec.api.sandbox import SandboxState
from dsec.api.spec import RunArgs
from dsec.api.trajectory import StepRequest
from dsec.api.verify import VerifyRequest
from dsec.errors import (
    AlreadyExists,
    DSecError,
    InvalidArgument,
    NotFound,
    ProcessNotFound,
    SandboxNotFound,
    TrajectoryStepInDoubt,
    Unsupported,
)
from dsec.net.ports import free_port
from dsec.rollouts.gateway import GatewayRollout, ModelGateway
from dsec.rollouts.listener import ListenerKeeper
from dsec.rollouts.store import Rollout, RolloutStore
from dsec.threads import acquire_in_thread

if TYPE_CHECKING:
    from dsec.apiserver.creator import SandboxCreator
    from dsec.edge.dataplane import DataPlane
    from dsec.edge.edge import Edge
    from dsec.fncall.service import FnCallService
    from dsec.rl.trajectory import TrajectoryService

log = logging.getLogger(__name__)

SANDBOX_CREATE_TIMEOUT = 300.0
RESUME_PROBE_INTERVAL = 1.0
WAIT_MAX = 600.0
#: How long a running sandbox's scaffold may be unknown to the data plane before the
#: rollout fails: its live restore (agent timeouts of 5 s) runs after a thaw or restart.
REATTACH_GRACE = 20.0
#: A rule that gives the agent sandbox a network namespace of its own with nothing
#: allowed in it (the gateway is reached through the edge's service port).
NO_EGRESS = {"host": False}


def agent_sandbox(spec: RolloutSpec, trajectory_id: str | None) -> RunArgs:
    """The agent sandbox's run args: the rollout's job and trajectory on it, no idle
    stop (the rollout's own timeout bounds it), and a network namespace with nothing
    allowed unless the spec says so (the gateway is reached through the service port).
    A cluster apiserver makes it with these (dsec.cluster.rollouts)."""
    sbx = spec.sandbox
    update: dict[str, Any] = {
        "job_id": spec.job_id,
        "trajectory_id": trajectory_id,
        "ttl_running_stop": None,
        "network_rules": dict(sbx.network_rules) or dict(NO_EGRESS),
    }
    return sbx.model_copy(update=update)


class Worker:
    """One rollout's live state beside its row (what the gateway counts)."""

    def __init__(self, ro: Rollout) -> None:
        self.ro = ro
        self.inflight = 0
        self.task: asyncio.Task[None] | None = None
        self.pausing: asyncio.Task[None] | None = None
        self.cancel_requested = False
        self.changed = asyncio.Event()

    # GatewayRollout
    @property
    def id(self) -> str:
        return self.ro.id

    @property
    def deadline(self) -> float:
        return self.ro.deadline

    @property
    def max_steps(self) -> int | None:
        return self.ro.spec.max_steps

    @property
    def calls_made(self) -> int:
        return self.ro.model_calls


class RolloutManager:
    """Owns the workers, the gateway and the store; served by the API routes."""

    def __init__(
        self,
        edge: Edge,
        dataplane: DataPlane,
        trajectory: TrajectoryService,
        store: RolloutStore,
        creator: SandboxCreator,
        fncall: FnCallService | None = None,
        *,
        listener: ListenerKeeper | None = None,
        keep_listener: bool = True,
    ) -> None:
        """``listener``: the gateway's listening socket outlives this edge (held calls
        survive its death: dsec.rollouts.listener); ``keep_listener=False``: let it go
        on a clean exit (an edge that stops its sandboxes on exit)."""
        self.listener = listener
        self.keep_listener = keep_listener
        self._sock: socket.socket | None = None
        self.fncall = fncall
        self.edge = edge
        self.dataplane = dataplane
        self.trajectory = trajectory
        self.store = store
        self.creator = creator
        self.workers: dict[str, Worker] = {}
        self._by_token: dict[str, Worker] = {}
        self.gateway: ModelGateway | None = None
        self._resumer: asyncio.Task[None] | None = None
        self._probe = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        self._closing = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        port = self._gateway_port()
        try:
            await self._serve_gateway(port)
        except OSError as exc:
            # Taken while the edge was down: a new port keeps the platform up; scaffolds
            # started before have the old one and fail their calls (said in the log).
            log.error("model gateway port %d: %s; live rollouts cannot reach it", port, exc)
            self.store.set_setting("gateway_port", "0")
            await self._serve_gateway(self._gateway_port(fresh=True))
        for ro in self.store.live():
            self._spawn(ro)
        self._resumer = asyncio.create_task(self._resume_loop())
        if self.workers:
            log.info("rollouts: %d live rollouts taken up again", len(self.workers))

    async def _serve_gateway(self, port: int) -> None:
        if self.edge.network is not None:
            self.edge.network.open_service_port(port)
        sock = None
        if self.listener is not None:
            listener = self.listener  # OSError: taken; cancel-safe (dsec.threads)
            sock = await acquire_in_thread(lambda: listener.acquire(port), socket.socket.close)
        self._sock = sock
        self.gateway = ModelGateway(self, port)
        await self.gateway.start(sock)
        if self.store.live():
            await self._keep_listener()

    async def _keep_listener(self) -> None:
        """Once rollouts use the gateway, its socket outlives this edge."""
        if self.listener is not None and self._sock is not None and not self.listener.kept:
            await asyncio.to_thread(self.listener.keep, self._sock)

    def _gateway_port(self, *, fresh: bool = False) -> int:
        """Stable across restarts: scaffolds have the gateway's address in their env."""
        saved = self.store.setting("gateway_port")
        if saved is not None and not fresh:
            return int(saved)
        wanted = 0 if fresh else int(os.environ.get("DSEC_GATEWAY_PORT", "0"))
        if not wanted:
            # Outside the ephemeral range (dsec.net.ports): while the edge is down, no
            # outgoing connection on the host can take the port its scaffolds were given.
            wanted = free_port("0.0.0.0")
        self.store.set_setting("gateway_port", str(wanted))
        return wanted

    async def close(self) -> None:
        """Stop following rollouts (they live on: the next edge takes them up)."""
        self._closing = True
        if self._resumer is not None:
            self._resumer.cancel()
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.gateway is not None:
            await self.gateway.close()
        if self.listener is not None:
            await asyncio.to_thread(self.listener.release, quit=not self.keep_listener)
        await self._probe.aclose()

    # -- API ------------------------------------------------------------------------------
    async def start_rollout(
        self, principal: str, spec: RolloutSpec, *, sandbox_id: str | None = None
    ) -> RolloutInfo:
        """``sandbox_id``: an agent sandbox made already on this edge (by a cluster
        apiserver, which placed and charged it: dsec.cluster.rollouts)."""
        if sandbox_id is not None:
            rec = self.edge.find(sandbox_id)
            if rec is None or rec.state is not SandboxState.RUNNING:
                raise SandboxNotFound(
                    f"no running sandbox {sandbox_id} on this edge", sandbox_id=sandbox_id
                )
        if spec.model is None and self.store.endpoint(spec.job_id) is None:
            raise InvalidArgument(
                f"job {spec.job_id!r} has no model endpoint: pass model=ModelEndpoint(...) "
                "or set_model_endpoint first"
            )
        if isinstance(spec.reward, FnCallJudge) and self.fncall is None:
            raise Unsupported("FnCall is off on this platform: a FnCall judge cannot run")
        if isinstance(spec.reward, VerifyRequest) and spec.reward.mode != "fresh":
            raise InvalidArgument("a rollout's reward step runs in fresh mode (the agent is done)")
        await self.creator.authorize(principal, spec.sandbox.project, "starting a rollout")
        # The edge's id first, as in a sandbox id: a cluster apiserver routes by it.
        rid = f"{self.edge.edge_id}-ro{secrets.token_hex(8)}"
        if spec.rollout_id is not None and self.trajectory.log.infos(spec.job_id, spec.rollout_id):
            raise AlreadyExists(
                f"trajectory {spec.job_id}/{spec.rollout_id} exists already: a hosted rollout "
                "starts a trajectory of its own (leave rollout_id out for a fresh one)",
                job_id=spec.job_id,
                rollout_id=spec.rollout_id,
            )
        now = time.time()
        ro = Rollout(
            id=rid,
            job_id=spec.job_id,
            rollout_id=spec.rollout_id or rid,
            principal=principal,
            spec=spec,
            state=RolloutState.STARTING,
            token="dsro_" + secrets.token_urlsafe(24),
            sandbox_id=sandbox_id,
            process_id=None,
            exit_code=None,
            reward=None,
            verdict=None,
            judgement=None,
            error=None,
            model_calls=0,
            model_retries=0,
            created_at=now,
            updated_at=now,
            finished_at=None,
            deadline=now + spec.timeout,
            acked=False,
        )
        await self._keep_listener()
        self.store.insert(ro)  # AlreadyExists (409) for a rollout id the job has
        if spec.model is not None:
            self.store.set_endpoint(spec.job_id, spec.model, only_if_unset=True)
        self._spawn(ro)
        return ro.info()

    def _row(self, rollout_id: str) -> Rollout:
        w = self.workers.get(rollout_id)
        if w is not None:
            return w.ro
        ro = self.store.get(rollout_id)
        if ro is None:
            raise NotFound(f"no rollout {rollout_id!r}", rollout_id=rollout_id)
        return ro

    def get(self, rollout_id: str) -> RolloutInfo:
        return self._row(rollout_id).info()

    def list(self, job_id: str, state: RolloutState | None = None) -> builtins.list[RolloutInfo]:
        return [ro.info() for ro in self.store.of_job(job_id, [state] if state else None)]

    async def wait(self, rollout_id: str, timeout: float) -> RolloutInfo:
        """The rollout once it is finished, failed or cancelled, or as it is at
        ``timeout`` (at most WAIT_MAX seconds: the client asks again)."""
        ro = self._row(rollout_id)
        w = self.workers.get(rollout_id)
        if w is not None and w.task is not None and not ro.state.terminal:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(w.task), min(timeout, WAIT_MAX))
        return self._row(rollout_id).info()

    async def cancel(self, principal: str, rollout_id: str) -> RolloutInfo:
        """End a rollout and its sandbox; needs what stopping that sandbox needs (the
        runtime role on its project), so one tenant cannot end another's rollouts."""
        ro = self._row(rollout_id)
        await self.creator.authorize(
            principal, ro.spec.sandbox.project, "cancelling a rollout", owner=ro.principal
        )
        w = self.workers.get(rollout_id)
        if w is None or ro.state.terminal or w.task is None:
            return ro.info()
        w.cancel_requested = True
        w.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(w.task, return_exceptions=True)
        return self._row(rollout_id).info()

    def finished(self, job_id: str, limit: int) -> builtins.list[RolloutResult]:
        """Finished, failed and cancelled rollouts of the job not acknowledged yet, with
        their trajectories: the same ones again until acknowledged (a trainer that died
        mid-read loses none), never again once acknowledged (none counted twice)."""
        out = []
        assert self.trajectory is not None
        for ro in self.store.of_job(job_id, sorted(TERMINAL), unacked_only=True, limit=limit):
            steps = self.trajectory.log.records(ro.job_id, ro.rollout_id, limit=1_000_000)
            out.append(RolloutResult(rollout=ro.info(), steps=steps))
        return out

    def ack(self, job_id: str, ids: builtins.list[str]) -> AckResult:
        acked, already, unknown = self.store.ack(job_id, ids)
        return AckResult(acked=acked, already=already, unknown=unknown)

    def set_endpoint(self, job_id: str, endpoint: ModelEndpoint) -> EndpointSet:
        """Every live rollout of the job uses ``endpoint`` from its next attempt on
        (held calls included)."""
        self.store.set_endpoint(job_id, endpoint, only_if_unset=False)
        live = sum(
            1 for w in self.workers.values() if w.ro.job_id == job_id and not w.ro.state.terminal
        )
        return EndpointSet(job_id=job_id, endpoint=endpoint.public(), rollouts=live)

    # -- gateway host ---------------------------------------------------------------------
    def by_token(self, token: str) -> GatewayRollout | None:
        w = self._by_token.get(token)
        if w is None or w.ro.state.terminal or w.ro.state is RolloutState.REWARDING:
            return None
        return w

    def caller_ok(self, ro: GatewayRollout, peer: str) -> bool:
        w = self.workers.get(ro.id)
        if w is None or w.ro.sandbox_id is None or self.edge.network is None:
            return False
        addr = self.edge.network.address_of(w.ro.sandbox_id)
        return addr is not None and addr[0] == peer

    def endpoint_for(self, ro: GatewayRollout) -> ModelEndpoint | None:
        w = self.workers.get(ro.id)
        if w is None:
            return None
        return self.store.endpoint(w.ro.job_id) or w.ro.spec.model

    async def held(self, ro: GatewayRollout, since: float) -> None:
        w = self.workers.get(ro.id)
        if w is None or w.ro.state.terminal:
            return
        self.store.bump(w.ro, retries=1)
        if w.ro.state is RolloutState.RUNNING:
            self._set(w, RolloutState.WAITING_FOR_MODEL)
        if (
            w.ro.state is RolloutState.WAITING_FOR_MODEL
            and time.monotonic() - since >= w.ro.spec.pause_after
            and w.pausing is None
        ):
            w.pausing = asyncio.create_task(self._pause(w))

    async def _pause(self, w: Worker) -> None:
        sid = w.ro.sandbox_id
        if sid is None:
            return
        try:
            res = await self.edge.jobs.pause_sandbox(sid)
        except DSecError as exc:
            log.warning("rollout %s: pausing %s failed: %s", w.id, sid, exc)
            return
        if res is not None and res.error is None and w.ro.state is RolloutState.WAITING_FOR_MODEL:
            self._set(w, RolloutState.PAUSED)

    async def through(self, ro: GatewayRollout) -> None:
        w = self.workers.get(ro.id)
        if w is not None and not w.ro.state.terminal:
            await self._wake(w)

    async def _wake(self, w: Worker) -> None:
        if w.pausing is not None:
            with contextlib.suppress(Exception):
                await w.pausing
            w.pausing = None
        if w.ro.state in (RolloutState.WAITING_FOR_MODEL, RolloutState.PAUSED):
            sid = w.ro.sandbox_id
            if sid is not None:
                rec = self.edge.find(sid)
                if rec is not None and rec.state is SandboxState.PAUSED:
                    self.edge.jobs.thaw(rec, cause="model endpoint back")
            self._set(w, RolloutState.RUNNING)

    def record(
        self, ro: GatewayRollout, request: dict[str, Any], ok: bool, result: dict[str, Any]
    ) -> None:
        w = self.workers.get(ro.id)
        if w is None or w.ro.sandbox_id is None:
            return  # the rollout ended while the call was in flight
        self.trajectory.log.append(
            w.ro.job_id,
            w.ro.rollout_id,
            w.ro.sandbox_id,
            "model_call",
            json.dumps(request, sort_keys=True, separators=(",", ":")),
            ok,
            json.dumps(result, separators=(",", ":"), default=str),
        )
        if "response" in result:  # the model answered (an error status too): it counts
            self.store.bump(w.ro, calls=1)

    # -- workers --------------------------------------------------------------------------
    def _spawn(self, ro: Rollout) -> None:
        w = Worker(ro)
        self.workers[ro.id] = w
        self._by_token[ro.token] = w
        w.task = asyncio.create_task(self._run(w), name=f"rollout-{ro.id}")
        w.task.add_done_callback(lambda _t: self._forget(w))

    def _forget(self, w: Worker) -> None:
        """An ended rollout lives on in the store only (its token is dead)."""
        if w.ro.state.terminal:
            self.workers.pop(w.id, None)
            self._by_token.pop(w.ro.token, None)

    def _set(self, w: Worker, state: RolloutState, **fields: Any) -> None:
        """A state change: durable first, then on the agent sandbox's audit record
        (provenance: when the rollout waited, paused, ended and why)."""
        before = w.ro.state
        self.store.update(w.ro, state=state, **fields)
        w.changed.set()
        if w.ro.sandbox_id is not None and before is not state:
            detail = {k: v for k, v in fields.items() if k in ("error", "exit_code")}
            self.edge.audit.record(
                w.ro.sandbox_id,
                AuditKind.LIFECYCLE,
                "rollout_" + state.value,
                job_id=w.ro.job_id,
                rollout=w.ro.id,
                **detail,
            )

    async def _run(self, w: Worker) -> None:
        ro = w.ro
        try:
            left = ro.deadline - time.time()
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                if ro.state is RolloutState.STARTING:
                    await self._provision(w)
                if ro.state in (
                    RolloutState.RUNNING,
                    RolloutState.WAITING_FOR_MODEL,
                    RolloutState.PAUSED,
                ):
                    await self._wait_scaffold(w)
                if ro.state is RolloutState.REWARDING:
                    await self._reward(w)
        except asyncio.CancelledError:
            if not w.cancel_requested or self._closing:
                raise  # the edge is going down: the rollout lives on
            await self._end(w, RolloutState.CANCELLED, "cancelled by request")
        except TimeoutError:
            await self._end(w, RolloutState.FAILED, "the rollout's timeout passed")
        except DSecError as exc:
            await self._end(w, RolloutState.FAILED, f"{exc.code}: {exc}")
        except Exception as exc:
            log.exception("rollout %s failed", ro.id)
            await self._end(w, RolloutState.FAILED, f"internal: {exc}")

    async def _provision(self, w: Worker) -> None:
        ro = w.ro
        spec = ro.spec
        if ro.sandbox_id is None:
            create = asyncio.ensure_future(
                self.creator.create_keyed(
                    ro.principal,
                    agent_sandbox(spec, ro.rollout_id),
                    timeout=SANDBOX_CREATE_TIMEOUT,
                    key=ro.id,
                )
            )
            try:
                info, _made = await asyncio.shield(create)
            except asyncio.CancelledError:
                # A cancel (or shutdown) mid-create: the create goes on; record what it
                # made, so that the cancel stops it and a next edge adopts it.
                with contextlib.suppress(Exception):
                    info, _made = await create
                    self.store.update(ro, sandbox_id=info.id)
                raise
            self.store.update(ro, sandbox_id=info.id)
        sid = ro.sandbox_id
        assert sid is not None
        if spec.files:
            await self._write_files(ro, sid)
        if ro.process_id is None:
            pid = self._adoptable(sid)
            if pid is None:
                addr = self.edge.network.address_of(sid) if self.edge.network else None
                if addr is None or self.gateway is None:
                    raise InvalidArgument("the agent sandbox has no network to reach the gateway")
                env = {
                    **spec.env,
                    "OPENAI_BASE_URL": f"http://{addr[1]}:{self.gateway.port}/v1",
                    "OPENAI_API_KEY": ro.token,
                    "DSEC_ROLLOUT_ID": ro.id,
                }
                proc = await self.dataplane.start(
                    sid,
                    CommandArgs(command=spec.scaffold, env=env, workdir=spec.workdir),
                    background=True,
                )
                pid = proc.id
            self.store.update(ro, process_id=pid)
        self._set(w, RolloutState.RUNNING)

    def _adoptable(self, sid: str) -> str | None:
        """A scaffold started before a restart (the only background process there)."""
        procs = self.dataplane.processes(sid)
        bg = [p for p in procs if p.background]
        return bg[0].id if bg else None

    async def _write_files(self, ro: Rollout, sid: str) -> None:
        steps = [
            StepRequest.model_validate(
                {
                    "step": i,
                    "sandbox_id": sid,
                    "file": {"path": path, "content_b64": base64.b64encode(text.encode()).decode()},
                }
            )
            for i, (path, text) in enumerate(sorted(ro.spec.files.items()))
        ]
        try:
            outs = await self.trajectory.run(ro.job_id, ro.rollout_id, steps)
        except TrajectoryStepInDoubt as exc:  # a file write is safe to do again
            self.trajectory.discard(ro.job_id, ro.rollout_id, int(exc.details.get("step", 0)))
            outs = await self.trajectory.run(ro.job_id, ro.rollout_id, steps)
        bad = [o for o in outs if not o.ok]
        if bad or len(outs) != len(steps):
            raise InvalidArgument(
                f"writing the rollout's files failed: {bad[0].body[:300] if bad else ''}"
            )

    async def _wait_scaffold(self, w: Worker) -> None:
        ro = w.ro
        assert ro.sandbox_id is not None and ro.process_id is not None
        missing_since: float | None = None
        while True:
            rec = self.edge.find(ro.sandbox_id)
            if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                why = "gone" if rec is None else rec.state.value
                raise SandboxNotFound(f"the agent sandbox {ro.sandbox_id} is {why}")
            try:
                proc = self.dataplane.process(ro.sandbox_id, ro.process_id)
            except ProcessNotFound:
                # Followed again once thawed (and after a restart): the data plane's
                # re-attach runs beside the thaw, so give it its own time bound.
                now = time.monotonic()
                if rec.state is SandboxState.RUNNING:
                    missing_since = missing_since or now
                    if now - missing_since > REATTACH_GRACE:
                        raise
                else:
                    missing_since = None
                await asyncio.sleep(0.2)
                continue
            try:
                exit_info = await proc.wait()
            except DSecError:
                if proc.suspended:  # a pause that dropped the agent link: follow again
                    await asyncio.sleep(0.2)
                    continue
                raise
            break
        self._set(w, RolloutState.REWARDING, exit_code=exit_info.exit_code)

    async def _reward(self, w: Worker) -> None:
        ro = w.ro
        spec = ro.spec
        if spec.reward is None:
            await self._end(w, RolloutState.FINISHED, None)
            return
        if isinstance(spec.reward, FnCallJudge):
            await self._judge(w, spec.reward)
            return
        if ro.verdict is not None:  # graded before a restart: the verdict stands
            await self._end(w, RolloutState.FINISHED, None)
            return
        sid = ro.sandbox_id
        assert sid is not None
        rec = self.edge.find(sid)
        if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise InvalidArgument(
                "the reward step was interrupted (edge restart) and its sandbox is gone"
            )
        verdict = await self.edge.verify(sid, spec.reward)
        reward = 1.0 if verdict.passed else 0.0
        with contextlib.suppress(ValueError, KeyError):
            reward = float(verdict.results["reward"]) if verdict.passed else 0.0
        self.store.update(ro, verdict=verdict.model_dump_json(), reward=reward)
        await self._end(w, RolloutState.FINISHED, None)

    async def _judge(self, w: Worker, judge: FnCallJudge) -> None:
        """Read the agent's file (data) and judge it in a FnCall sandbox; a pure
        function of that file, so a restart in the middle simply judges it again."""
        ro = w.ro
        assert ro.sandbox_id is not None and self.fncall is not None
        try:
            code = await self.edge.read_file(
                ro.sandbox_id, judge.code_path, max_bytes=MAX_JUDGED_BYTES
            )
        except NotFound:
            code = b""
        if not code:
            self.store.update(ro, reward=0.0)
            await self._end(w, RolloutState.FINISHED, f"no program at {judge.code_path}")
            return
        res = await self.fncall.judge(
            JudgeRequest(
                args=judge.args,
                code=code.decode(errors="replace"),
                tests=judge.tests,
                comparator=judge.comparator,
                float_tolerance=judge.float_tolerance,
            )
        )
        self.store.update(
            ro, judgement=res.model_dump_json(), reward=res.passed / max(1, res.total)
        )
        await self._end(w, RolloutState.FINISHED, None)

    async def _end(self, w: Worker, state: RolloutState, error: str | None) -> None:
        ro = w.ro
        if (
            ro.process_id is not None
            and ro.sandbox_id is not None
            and state is not RolloutState.FINISHED
        ):
            with contextlib.suppress(DSecError):
                await self.dataplane.process(ro.sandbox_id, ro.process_id).kill()
        self._set(w, state, error=error)
        if ro.sandbox_id is not None:
            with contextlib.suppress(DSecError):
                await asyncio.shield(self.creator.stop(ro.principal, ro.sandbox_id))

    # -- resuming paused rollouts ---------------------------------------------------------
    async def _resume_loop(self) -> None:
        while True:
            await asyncio.sleep(RESUME_PROBE_INTERVAL)
            idle = [
                w
                for w in self.workers.values()
                if w.ro.state is RolloutState.PAUSED
                and w.inflight == 0
                and (w.pausing is None or w.pausing.done())
            ]
            seen: dict[str, bool] = {}
            for w in idle:
                ep = self.endpoint_for(w)
                if ep is None:
                    continue
                if ep.base_url not in seen:
                    seen[ep.base_url] = await self._up(ep)
                if seen[ep.base_url]:
                    await self._wake(w)

    async def _up(self, ep: ModelEndpoint) -> bool:
        headers = {"authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
        try:
            resp = await self._probe.get(ep.base_url + "/models", headers=headers)
        except httpx.HTTPError:
            return False
        return resp.status_code < 500
