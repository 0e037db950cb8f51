"""/v1/rollouts and /v1/jobs/{job}/rollouts|model-endpoint: hosted rollouts.

Start a rollout (an agent sandbox, a scaffold in it, a worker on the edge), follow and
cancel it, point a job's rollouts at the trainer's current model endpoint, and hand
finished rollouts to the trainer exactly once (list, then acknowledge). The rollouts
live on an edge (dsec.rollouts.manager): the one serving these routes (``dsec up``), or
the one a cluster apiserver routes to (dsec.cluster.rollouts).

Who may do what (dsec.control.jobs): a job belongs to the project that first used it;
starting a rollout or setting the endpoint claims the job, and every other job route
needs ``runtime`` on the job's project (403 otherwise). A rollout of a project the
caller has no role on is answered 404, exactly as an id that does not exist, so ids
cannot be probed; the job's lists leave such rollouts out, and acknowledging one
reports it ``unknown``.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
import asyncio
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Query
from pydantic import TypeAdapter
from starlette.responses import Response

from dsec.api.rollouts import (
    AckRequest,
    AckResult,
    EndpointSet,
    ModelEndpoint,
    RolloutInfo,
    RolloutResult,
    RolloutSpec,
    RolloutState,
)
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.control.jobs import JobAccess
from dsec.errors import NotFound, PermissionDenied
from dsec.rl.jobs import check_job_id
from dsec.rollouts.manager import RolloutManager

_JSON = "application/json"
#: Rollouts looked up at once while checking an ack's ids.
ACK_LOOKUPS = 32
_infos: TypeAdapter[list[RolloutInfo]] = TypeAdapter(list[RolloutInfo])
_results: TypeAdapter[list[RolloutResult]] = TypeAdapter(list[RolloutResult])


class Rollouts(Protocol):
    """Where rollouts live: this edge (LocalRollouts) or a cluster's edges."""

    async def start(
        self, principal: str, spec: RolloutSpec, sandbox_id: str | None
    ) -> RolloutInfo: ...
    async def get(self, rollout_id: str) -> RolloutInfo: ...
    async def of_job(self, job_id: str, state: RolloutState | None) -> list[RolloutInfo]: ...
    async def wait(self, rollout_id: str, timeout: float) -> RolloutInfo: ...
    async def cancel(self, principal: str, rollout_id: str) -> RolloutInfo: ...
    async def finished(self, job_id: str, limit: int) -> list[RolloutResult]: ...
    async def ack(self, job_id: str, ids: list[str]) -> AckResult: ...
    async def set_endpoint(self, job_id: str, endpoint: ModelEndpoint) -> EndpointSet: ...


class LocalRollouts:
    """The rollouts of the edge in this process."""

    def __init__(self, manager: RolloutManager) -> None:
        self.manager = manager

    async def start(self, principal: str, spec: RolloutSpec, sandbox_id: str | None) -> RolloutInfo:
        return await self.manager.start_rollout(principal, spec, sandbox_id=sandbox_id)

    async def get(self, rollout_id: str) -> RolloutInfo:
        return self.manager.get(rollout_id)

    async def of_job(self, job_id: str, state: RolloutState | None) -> list[RolloutInfo]:
        return self.manager.list(job_id, state)

    async def wait(self, rollout_id: str, timeout: float) -> RolloutInfo:
        return await self.manager.wait(rollout_id, timeout)

    async def cancel(self, principal: str, rollout_id: str) -> RolloutInfo:
        return await self.manager.cancel(principal, rollout_id)

    async def finished(self, job_id: str, limit: int) -> list[RolloutResult]:
        return self.manager.finished(job_id, limit)

    async def ack(self, job_id: str, ids: list[str]) -> AckResult:
        return self.manager.ack(job_id, ids)

    async def set_endpoint(self, job_id: str, endpoint: ModelEndpoint) -> EndpointSet:
        return self.manager.set_endpoint(job_id, endpoint)


def not_found(rollout_id: str) -> NotFound:
    return NotFound(f"no rollout {rollout_id!r}", rollout_id=rollout_id)


def rollout_router(
    rollouts: Rollouts | RolloutManager, auth: Authenticator, access: JobAccess
) -> APIRouter:
    backend: Rollouts = (
        LocalRollouts(rollouts) if isinstance(rollouts, RolloutManager) else rollouts
    )
    router = APIRouter(
        tags=["rollouts"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]

    async def visible(principal: str, rollout_id: str) -> RolloutInfo:
        """The rollout if the caller may see it; 404 alike for others' and none."""
        try:
            info = await backend.get(rollout_id)
        except NotFound:
            raise not_found(rollout_id) from None
        if not await access.may_see(principal, info.project):
            raise not_found(rollout_id)
        return info

    @router.post("/v1/rollouts", response_model=RolloutInfo, status_code=201, summary="Start")
    async def start(
        body: RolloutSpec,
        principal: Principal,
        sandbox_id: Annotated[
            str | None,
            Query(
                max_length=64,
                description="cluster apiservers only: the agent sandbox, made and charged "
                "already on this edge",
            ),
        ] = None,
    ) -> Response:
        """Start a rollout; it runs on the platform whatever happens to the caller."""
        if sandbox_id is not None and access.enforced:
            # Where tenants call, a rollout never adopts a sandbox named by the caller.
            raise PermissionDenied("sandbox_id is for a cluster apiserver calling its edge")
        project = await access.claim(
            principal, body.job_id, body.sandbox.project, "starting a rollout"
        )
        if project != body.sandbox.project:  # the rollout carries its project
            sandbox = body.sandbox.model_copy(update={"project": project})
            body = body.model_copy(update={"sandbox": sandbox})
        return model_response(await backend.start(principal, body, sandbox_id), 201)

    @router.get("/v1/rollouts", response_model=list[RolloutInfo], summary="A job's rollouts")
    async def list_rollouts(
        principal: Principal,
        job_id: Annotated[str, Query(max_length=128)],
        state: RolloutState | None = None,
    ) -> Response:
        job = check_job_id(job_id)
        await access.require(principal, job, "listing a job's rollouts")
        items = [
            i
            for i in await backend.of_job(job, state)
            if await access.may_see(principal, i.project)
        ]
        return Response(_infos.dump_json(items), media_type=_JSON)

    @router.get("/v1/rollouts/{rollout_id}", response_model=RolloutInfo, summary="One rollout")
    async def get(rollout_id: str, principal: Principal) -> Response:
        return model_response(await visible(principal, rollout_id))

    @router.post(
        "/v1/rollouts/{rollout_id}/wait", response_model=RolloutInfo, summary="Wait for the end"
    )
    async def wait(
        rollout_id: str,
        principal: Principal,
        timeout: Annotated[float, Query(gt=0, le=600)] = 60.0,
    ) -> Response:
        """The rollout once it ended, or as it is after ``timeout`` seconds."""
        await visible(principal, rollout_id)
        return model_response(await backend.wait(rollout_id, timeout))

    @router.post("/v1/rollouts/{rollout_id}/cancel", response_model=RolloutInfo, summary="Cancel")
    async def cancel(rollout_id: str, principal: Principal) -> Response:
        await visible(principal, rollout_id)
        return model_response(await backend.cancel(principal, rollout_id))

    @router.get(
        "/v1/jobs/{job_id}/rollouts/finished",
        response_model=list[RolloutResult],
        summary="Ended rollouts not acknowledged yet, with their trajectories",
    )
    async def finished(
        job_id: str, principal: Principal, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> Response:
        job = check_job_id(job_id)
        await access.require(principal, job, "reading a job's finished rollouts")
        items = [
            r
            for r in await backend.finished(job, limit)
            if await access.may_see(principal, r.rollout.project)
        ]
        return Response(_results.dump_json(items), media_type=_JSON)

    @router.post("/v1/jobs/{job_id}/rollouts/ack", response_model=AckResult, summary="Acknowledge")
    async def ack(job_id: str, body: AckRequest, principal: Principal) -> Response:
        """Acknowledged rollouts are never listed as finished again. Ids the caller may
        not see are ``unknown`` (and left as they are)."""
        job = check_job_id(job_id)
        await access.require(principal, job, "acknowledging a job's rollouts")
        ids = list(dict.fromkeys(body.ids))
        gate = asyncio.Semaphore(ACK_LOOKUPS)

        async def seen(rid: str) -> bool:
            async with gate:  # a cluster asks each id's edge
                try:
                    await visible(principal, rid)
                except NotFound:
                    return False
                return True

        shown = await asyncio.gather(*(seen(rid) for rid in ids))
        mine = [rid for rid, ok in zip(ids, shown, strict=True) if ok]
        hidden = [rid for rid, ok in zip(ids, shown, strict=True) if not ok]
        result = (
            await backend.ack(job, mine) if mine else AckResult(acked=[], already=[], unknown=[])
        )
        result.unknown.extend(hidden)
        return model_response(result)

    @router.put(
        "/v1/jobs/{job_id}/model-endpoint",
        response_model=EndpointSet,
        summary="Point the job's rollouts at a model endpoint",
    )
    async def set_endpoint(job_id: str, body: ModelEndpoint, principal: Principal) -> Response:
        job = check_job_id(job_id)
        await access.claim(principal, job, None, "setting a job's model endpoint")
        return model_response(await backend.set_endpoint(job, body))

    return router
