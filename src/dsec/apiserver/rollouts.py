"""/v1/rollouts and /v1/jobs/{job}/rollouts|model-endpoint: hosted rollouts.

Start a rollout (an agent sandbox, a scaffold in it, a worker on the edge), follow and
cancel it, point a job's rollouts at the trainer's current model endpoint, and hand
finished rollouts to the trainer exactly once (list, then acknowledge). The rollouts
live on the edge that serves these routes (dsec.rollouts.manager).
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
from typing import Annotated

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
from dsec.rl.jobs import check_job_id
from dsec.rollouts.manager import RolloutManager

_JSON = "application/json"
_infos: TypeAdapter[list[RolloutInfo]] = TypeAdapter(list[RolloutInfo])
_results: TypeAdapter[list[RolloutResult]] = TypeAdapter(list[RolloutResult])


def rollout_router(manager: RolloutManager, auth: Authenticator) -> APIRouter:
    router = APIRouter(
        tags=["rollouts"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]

    @router.post("/v1/rollouts", response_model=RolloutInfo, status_code=201, summary="Start")
    async def start(body: RolloutSpec, principal: Principal) -> Response:
        """Start a rollout; it runs on the platform whatever happens to the caller."""
        return model_response(await manager.start_rollout(principal, body), 201)

    @router.get("/v1/rollouts", response_model=list[RolloutInfo], summary="A job's rollouts")
    async def list_rollouts(
        _p: Principal,
        job_id: Annotated[str, Query(max_length=128)],
        state: RolloutState | None = None,
    ) -> Response:
        items = manager.list(check_job_id(job_id), state)
        return Response(_infos.dump_json(items), media_type=_JSON)

    @router.get("/v1/rollouts/{rollout_id}", response_model=RolloutInfo, summary="One rollout")
    async def get(rollout_id: str, _p: Principal) -> Response:
        return model_response(manager.get(rollout_id))

    @router.post(
        "/v1/rollouts/{rollout_id}/wait", response_model=RolloutInfo, summary="Wait for the end"
    )
    async def wait(
        rollout_id: str,
        _p: Principal,
        timeout: Annotated[float, Query(gt=0, le=600)] = 60.0,
    ) -> Response:
        """The rollout once it ended, or as it is after ``timeout`` seconds."""
        return model_response(await manager.wait(rollout_id, timeout))

    @router.post("/v1/rollouts/{rollout_id}/cancel", response_model=RolloutInfo, summary="Cancel")
    async def cancel(rollout_id: str, principal: Principal) -> Response:
        return model_response(await manager.cancel(principal, rollout_id))

    @router.get(
        "/v1/jobs/{job_id}/rollouts/finished",
        response_model=list[RolloutResult],
        summary="Ended rollouts not acknowledged yet, with their trajectories",
    )
    async def finished(
        job_id: str, _p: Principal, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> Response:
        items = manager.finished(check_job_id(job_id), limit)
        return Response(_results.dump_json(items), media_type=_JSON)

    @router.post("/v1/jobs/{job_id}/rollouts/ack", response_model=AckResult, summary="Acknowledge")
    async def ack(job_id: str, body: AckRequest, _p: Principal) -> Response:
        """Acknowledged rollouts are never listed as finished again."""
        return model_response(manager.ack(check_job_id(job_id), body.ids))

    @router.put(
        "/v1/jobs/{job_id}/model-endpoint",
        response_model=EndpointSet,
        summary="Point the job's rollouts at a model endpoint",
    )
    async def set_endpoint(job_id: str, body: ModelEndpoint, _p: Principal) -> Response:
        return model_response(manager.set_endpoint(check_job_id(job_id), body))

    return router
