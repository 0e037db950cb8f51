"""/v1/jobs (pause, resume), /v1/sandboxes/{id}/pack|fork and /v1/roles: RL co-design.

Packing publishes an environment other sandboxes start from, so it needs the
``builder`` role (dsec.control.roles); pausing and resuming a job does not (it only
touches that job's own sandboxes). Granting roles is for the admin principal only.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends
from starlette.responses import Response

from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.params import check_sandbox_id
from dsec.apiserver.responses import model_response
from dsec.control.roles import ADMIN, Role, RoleStore
from dsec.errors import PermissionDenied
from dsec.rl.jobs import check_job_id
from dsec.rl_model import (
    ForkRequest,
    ForkResult,
    JobPauseReport,
    JobResumeReport,
    PackedEnv,
    PackRequest,
)


class RLEdge(Protocol):
    async def pause_job(self, job_id: str) -> JobPauseReport: ...
    async def resume_job(self, job_id: str) -> JobResumeReport: ...
    async def pack_diff(self, sandbox_id: str, name: str, version: str) -> PackedEnv: ...
    async def fork(self, sandbox_id: str, req: ForkRequest) -> ForkResult: ...


def rl_router(edge: RLEdge, auth: Authenticator, roles: RoleStore) -> APIRouter:
    router = APIRouter(
        tags=["rl"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]

    @router.post("/v1/jobs/{job_id}/pause", response_model=JobPauseReport, summary="Pause a job")
    async def pause_job(job_id: str, _p: Principal) -> Response:
        """Freeze every running sandbox of the job and reclaim its memory; all state is
        kept. The next request to one of them, or resume, thaws it."""
        return model_response(await edge.pause_job(check_job_id(job_id)))

    @router.post("/v1/jobs/{job_id}/resume", response_model=JobResumeReport, summary="Resume a job")
    async def resume_job(job_id: str, _p: Principal) -> Response:
        return model_response(await edge.resume_job(check_job_id(job_id)))

    @router.post(
        "/v1/sandboxes/{sandbox_id}/pack",
        response_model=PackedEnv,
        summary="Pack a sandbox's changes into a layer (builder role)",
    )
    async def pack(sandbox_id: str, body: PackRequest, principal: Principal) -> Response:
        await roles.require(principal, Role.BUILDER, "pack_diff")
        env = await edge.pack_diff(check_sandbox_id(sandbox_id), body.name, body.version)
        return model_response(env, 201)

    @router.post(
        "/v1/sandboxes/{sandbox_id}/fork",
        response_model=ForkResult,
        summary="pack_diff + n sandboxes from it (builder role)",
    )
    async def fork(sandbox_id: str, body: ForkRequest, principal: Principal) -> Response:
        await roles.require(principal, Role.BUILDER, "fork")
        return model_response(await edge.fork(check_sandbox_id(sandbox_id), body), 201)

    @router.put("/v1/roles/{principal}/{role}", summary="Grant a role (admin only)")
    async def grant(principal: str, role: str, caller: Principal) -> dict[str, str]:
        _admin(caller)
        await roles.grant(principal, role)
        return {"principal": principal, "role": role}

    @router.delete("/v1/roles/{principal}/{role}", summary="Revoke a role (admin only)")
    async def revoke(principal: str, role: str, caller: Principal) -> dict[str, object]:
        _admin(caller)
        return {
            "principal": principal,
            "role": role,
            "revoked": await roles.revoke(principal, role),
        }

    return router


def _admin(principal: str) -> None:
    if principal != ADMIN:
        raise PermissionDenied("only the admin principal may grant or revoke roles")
