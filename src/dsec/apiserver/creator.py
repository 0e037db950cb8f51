"""The one path by which a sandbox comes to be and ends, for single creates and batches.

Every create goes through ``SandboxCreator`` so that authorisation, the project quota
charge, placement and the release of the charge when the sandbox ends are done in one
place, whether the edge is in-process (``dsec up``) or a cluster router
(dsec.cluster). Keeping it out of the HTTP handlers lets batch creation reuse it.

With IAM (dsec.control.iam): the project is ``spec.project`` or the principal's
default; the principal needs ``runtime`` there (403); the sandbox is charged to the
project's chain (429) *before* the edge does any work. An edge that names sandboxes up
front (dsec.edge.api.NamedCreates: the in-process edge of `dsec up`) is asked for the
id first and the charge is made under it: one quota write per create. Otherwise (a
cluster router: the edge it places on picks the id) the charge is made under a
provisional id and moved to the real one once the sandbox runs. A failed or cancelled
create releases it. Without IAM (unit tests of the HTTP layer) it is a pass-through.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dsec.api.sandbox import IDEMPOTENCY_HEADER, SandboxInfo, SandboxState
from dsec.api.spec import RunArgs
from dsec.backends.kinds import require_backend
from dsec.control.iam import IAM, Role
from dsec.control.jobs import JobAccess
from dsec.edge.api import EdgeAPI, KeyedCreates, NamedCreates
from dsec.edge.idempotency import IdempotencyClaim
from dsec.errors import Unsupported

if TYPE_CHECKING:
    from dsec.edge.edge import Edge

log = logging.getLogger(__name__)


class SandboxCreator:
    def __init__(self, edge: EdgeAPI, *, iam: IAM | None = None) -> None:
        self.edge = edge
        self.iam = iam
        #: Who may touch which job (its sandboxes, rollouts, trajectories).
        self.jobs = JobAccess(iam)
        # Looked up once: a protocol check per create costs more than the rest of it.
        self._named = edge if isinstance(edge, NamedCreates) else None

    async def authorize(
        self, principal: str, project: str | None, action: str, *, owner: str | None = None
    ) -> None:
        """Raise PermissionDenied (403) unless ``principal`` may run sandboxes in
        ``project`` (None: the default project of ``owner``, who asked for the work,
        else of ``principal``): for work that creates or ends sandboxes
        later on the principal's behalf (a hosted rollout), so that a refusal is typed at
        the request, not a failure found afterwards. Without IAM everyone may."""
        iam = self.iam
        if iam is None:
            return
        where = project or await iam.default_project(owner or principal)
        await iam.require(principal, Role.RUNTIME, where, action)

    async def create(self, principal: str, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        """Create one sandbox on behalf of ``principal``; returns once it runs."""
        require_backend(spec)  # 501 before the quota is charged or an edge is picked
        iam = self.iam
        if iam is None:
            return await self.edge.create(spec, timeout=timeout)
        project = spec.project or await iam.default_project(principal)
        await iam.require(principal, Role.RUNTIME, project, "creating a sandbox")
        if spec.job_id is not None:  # another tenant's job id: 403
            await self.jobs.claim(principal, spec.job_id, project, "creating a sandbox")
        named = self._named
        charged = named.new_sandbox_id(spec) if named is not None else iam.provisional_id()
        try:
            await iam.charge(project, charged, spec.cpu_cores_limit, spec.memory_limit_mb)
        except BaseException:
            if named is not None:  # e.g. over quota: a warm sandbox held for it is free again
                named.forget_sandbox_id(charged)
            raise
        if spec.project != project:
            spec = spec.model_copy(update={"project": project})
        try:
            if named is not None:
                # Charged under its final id: nothing to move afterwards. A crash in
                # between leaves a charge recovery releases (attach_iam: not live).
                return await named.create_named(spec, timeout=timeout, sandbox_id=charged)
            info = await self.edge.create(spec, timeout=timeout)
        except BaseException:
            await asyncio.shield(iam.release(charged))
            if named is not None:
                # Only now, with no charge left under the id: a warm sandbox held for it
                # goes back to the pool, and the next create it is handed to charges
                # under the same id (given back first, that charge found this one still
                # on record: 409 already_exists to an innocent create).
                named.forget_sandbox_id(charged)
            raise
        await self._bind_charge(charged, info)
        return info

    async def create_keyed(
        self, principal: str, spec: RunArgs, *, timeout: float, key: str
    ) -> tuple[SandboxInfo, bool]:
        """Create at most once per Idempotency-Key ``key`` of ``principal`` (and its
        project): (info, True) when this request made the sandbox, (info, False) when an
        earlier one with the key did (dsec.edge.idempotency). Only a create that is made
        is charged to the project. Unsupported (501) from an edge that cannot keep keys."""
        require_backend(spec)  # 501 before the quota is charged or an edge is picked
        edge = self.edge
        if not isinstance(edge, KeyedCreates):
            raise Unsupported(
                f"{IDEMPOTENCY_HEADER} is not supported by this edge; create without it "
                "(and list by label to find a create whose answer was lost)"
            )
        iam = self.iam
        project = ""
        if iam is not None:
            project = spec.project or await iam.default_project(principal)
            await iam.require(principal, Role.RUNTIME, project, "creating a sandbox")
            if spec.job_id is not None:  # another tenant's job id: 403
                await self.jobs.claim(principal, spec.job_id, project, "creating a sandbox")
        claim = IdempotencyClaim.of(f"{principal}\n{project}", key, spec)
        found = await edge.replay(claim, timeout=timeout)
        if found is not None:
            return found, False
        if iam is None:
            return await edge.create_keyed(spec, timeout=timeout, claim=claim)
        provisional = iam.provisional_id()
        await iam.charge(project, provisional, spec.cpu_cores_limit, spec.memory_limit_mb)
        if spec.project != project:
            spec = spec.model_copy(update={"project": project})
        try:
            info, made = await edge.create_keyed(spec, timeout=timeout, claim=claim)
        except BaseException:
            await asyncio.shield(iam.release(provisional))
            raise
        if not made:  # an earlier create with the key won the race: it holds the charge
            await asyncio.shield(iam.release(provisional))
            return info, False
        await self._bind_charge(provisional, info)
        return info, True

    async def _bind_charge(self, provisional: str, info: SandboxInfo) -> None:
        assert self.iam is not None
        try:
            await asyncio.shield(self.iam.rebind(provisional, info.id))
        except Exception:
            # Never strand a running sandbox behind a failed bookkeeping write: stop it
            # and give the charge back, then report the failure.
            await asyncio.shield(self.edge.stop(info.id, reason="quota charge failed"))
            await asyncio.shield(self.iam.release(provisional))
            raise

    async def stop(self, principal: str, sandbox_id: str) -> SandboxInfo:
        """Stop a sandbox on behalf of ``principal``; idempotent. Needs ``runtime`` on
        the sandbox's project; releases its charge."""
        iam = self.iam
        if iam is None:
            return await self.edge.stop(sandbox_id)
        current = await self.edge.get(sandbox_id)
        project = current.spec.project or iam.default
        await iam.require(principal, Role.RUNTIME, project, "stopping a sandbox")
        info = await self.edge.stop(sandbox_id)
        await iam.release(sandbox_id)
        return info


class StopReleaser:
    """Releases the charge of every sandbox the edge ends, whoever ends it (a stop, the
    idle TTL, a failure, shutdown). The edge calls listeners synchronously, so the
    release runs as a task; ``drain`` awaits the ones in flight before the database
    goes away."""

    def __init__(self, iam: IAM) -> None:
        self.iam = iam
        self._tasks: set[asyncio.Task[bool]] = set()

    def __call__(self, sandbox_id: str, _reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.iam.release(sandbox_id))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[bool]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing a quota charge failed: %s", task.exception())

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def attach_iam(edge: Edge, iam: IAM) -> StopReleaser:
    """Single-node wiring: release on every end, and give back the charges of
    sandboxes that ended while the platform was down (recovery)."""
    releaser = StopReleaser(iam)
    edge.add_stop_listener(releaser)
    live = {info.id for info in await edge.list(states={s for s in SandboxState if not s.terminal})}
    gone = await iam.reconcile(live, prefix=f"{edge.edge_id}-", pending_older_than=0.0)
    if gone:
        log.info("released the quota charges of %d sandboxes that ended meanwhile", len(gone))
    return releaser
