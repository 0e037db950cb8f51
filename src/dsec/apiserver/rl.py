"""/v1/jobs (pause, resume), /v1/sandboxes/{id}/pack|fork and /v1/roles: RL co-design.

Packing publishes an environment other sandboxes start from, so it needs the
``builder`` role on the sandbox's project or an ancestor (dsec.control.iam); pausing
and resuming a job needs ``runtime`` on the job's project (dsec.control.jobs).
``/v1/roles/{principal}/{role}`` grants and revokes on ROOT (every project), so only a
root admin may (bounded delegation); per-project roles: /v1/projects/{path}/-/roles.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
import asyncio
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends
from starlette.responses import Response

from dsec.api.rl import (
    ForkRequest,
    ForkResult,
    JobPauseReport,
    JobResumeReport,
    PackedEnv,
    PackRequest,
)
from dsec.api.sandbox import SandboxInfo
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.control.iam import IAM, Request
from dsec.control.jobs import JobAccess
from dsec.control.roles import Role, RoleStore
from dsec.errors import QuotaExceeded
from dsec.rl.jobs import check_job_id


class RLEdge(Protocol):
    async def pause_job(self, job_id: str) -> JobPauseReport: ...
    async def resume_job(self, job_id: str) -> JobResumeReport: ...
    async def pack_diff(self, sandbox_id: str, name: str, version: str) -> PackedEnv: ...
    async def fork(self, sandbox_id: str, req: ForkRequest) -> ForkResult: ...
    async def get(self, sandbox_id: str) -> SandboxInfo: ...


def rl_router(
    edge: RLEdge,
    auth: Authenticator,
    roles: RoleStore,
    access: JobAccess,
    sandboxes: SandboxAccess | None = None,
    *,
    charge: bool = True,
) -> APIRouter:
    """``charge=False`` on a cluster edge: its apiservers charged the fork already."""
    router = APIRouter(
        tags=["rl"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]
    sandboxes = sandboxes or SandboxAccess(edge, roles.iam if charge else None, auth)
    # Builder on the path's sandbox's project; no role there at all: 404 (not 403).
    Built = Annotated[str, Depends(sandboxes.builder)]

    async def require_builder(principal: str, sandbox_id: str, action: str) -> SandboxInfo:
        """Builder on the sandbox's project (sandboxes from before IAM: the default)."""
        info = await edge.get(sandbox_id)
        project = info.spec.project or roles.iam.default
        await roles.require(principal, Role.BUILDER, action, project=project)
        return info

    @router.post("/v1/jobs/{job_id}/pause", response_model=JobPauseReport, summary="Pause a job")
    async def pause_job(job_id: str, principal: Principal) -> Response:
        """Freeze every running sandbox of the job and reclaim its memory; all state is
        kept. The next request to one of them, or resume, thaws it. Needs ``runtime``
        on the job's project (dsec.control.jobs)."""
        job = check_job_id(job_id)
        await access.require(principal, job, "pausing a job")
        return model_response(await edge.pause_job(job))

    @router.post("/v1/jobs/{job_id}/resume", response_model=JobResumeReport, summary="Resume a job")
    async def resume_job(job_id: str, principal: Principal) -> Response:
        job = check_job_id(job_id)
        await access.require(principal, job, "resuming a job")
        return model_response(await edge.resume_job(job))

    @router.post(
        "/v1/sandboxes/{sandbox_id}/pack",
        response_model=PackedEnv,
        summary="Pack a sandbox's changes into a layer (builder role)",
    )
    async def pack(sandbox_id: Built, body: PackRequest, principal: Principal) -> Response:
        sid = sandbox_id
        await require_builder(principal, sid, "pack_diff")
        env = await edge.pack_diff(sid, body.name, body.version)
        return model_response(env, 201)

    @router.post(
        "/v1/sandboxes/{sandbox_id}/fork",
        response_model=ForkResult,
        summary="pack_diff + n sandboxes from it (builder role)",
    )
    async def fork(sandbox_id: Built, body: ForkRequest, principal: Principal) -> Response:
        sid = sandbox_id
        parent = await require_builder(principal, sid, "fork")
        if not charge:
            return model_response(await edge.fork(sid, body), 201)
        return model_response(await charged_fork(roles.iam, edge, parent, body), 201)

    @router.put("/v1/roles/{principal}/{role}", summary="Grant a role on every project")
    async def grant(principal: str, role: str, caller: Principal) -> dict[str, str]:
        await roles.grant(principal, role, caller=caller)
        return {"principal": principal, "role": role}

    @router.delete("/v1/roles/{principal}/{role}", summary="Revoke a role on every project")
    async def revoke(principal: str, role: str, caller: Principal) -> dict[str, object]:
        return {
            "principal": principal,
            "role": role,
            "revoked": await roles.revoke(principal, role, caller=caller),
        }

    return router


async def charged_fork(
    iam: IAM, edge: RLEdge, parent: SandboxInfo, body: ForkRequest
) -> ForkResult:
    """Fork's children are sandboxes too: all ``n`` are charged to the parent's project
    before any starts (all or none: a partial fork is no use to a trainer), and each
    charge moves to its child's id once the child runs."""
    project = parent.spec.project or iam.default
    ids = [iam.provisional_id() for _ in range(body.n)]
    demand = [Request(i, parent.spec.cpu_cores_limit, parent.spec.memory_limit_mb) for i in ids]
    fitted = await iam.charge_many(project, demand)
    if fitted < body.n:
        await iam.release_many(ids[:fitted])
        raise QuotaExceeded(
            f"quota of {project!r} (or an ancestor's) has room for {fitted} of the "
            f"{body.n} forked sandboxes; `dsec quota show {project}` says which limit",
            project=project,
            requested=body.n,
            fits=fitted,
        )
    try:
        result = await edge.fork(parent.id, body)
    except BaseException:
        await asyncio.shield(iam.release_many(ids))
        raise
    for provisional, child in zip(ids, result.children, strict=False):
        await iam.rebind(provisional, child.id)
    if len(result.children) < len(ids):
        await iam.release_many(ids[len(result.children) :])
    return result
