"""/v1/trajectories: log and replay steps of RL rollouts; query and export the log.

``POST /v1/trajectories/{job}/{rollout}/steps`` takes one or many consecutive steps (a
batch is how a resumed trainer fast-forwards thousands of steps in one round trip); the
replay decision itself lives in ``dsec.rl.trajectory``. The body is parsed and the
answer assembled by hand: logged results are stored as JSON text and sent back as is.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from dsec.api.exec import TrajectoryRef
from dsec.api.trajectory import StepAnswer, StepBatch, StepRecord, TrajectoryInfo, check_name
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.params import INT64_MAX
from dsec.control.jobs import JobAccess
from dsec.errors import InvalidArgument, NotFound
from dsec.rl.trajectory import TrajectoryService

_JSON = "application/json"


def trajectory_ref(
    job_id: str | None, rollout_id: str | None, step: int | None
) -> TrajectoryRef | None:
    """The trajectory query parameters of a plain route: all three or none."""
    if job_id is None and rollout_id is None and step is None:
        return None
    if job_id is None or rollout_id is None or step is None:
        raise InvalidArgument("a trajectory step needs job_id, rollout_id and step together")
    try:
        return TrajectoryRef(job_id=job_id, rollout_id=rollout_id, step=step)
    except ValidationError as exc:
        raise InvalidArgument(f"bad trajectory reference: {_summary(exc)}") from None


def _summary(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )


class TrajectoryRemote(Protocol):
    """Logs kept elsewhere (cluster mode: on the edges, dsec.cluster.fanout)."""

    async def steps(self, job: str, rollout: str, body: bytes, batch: StepBatch) -> Response: ...
    async def job(self, job: str, format: str, rollout: str | None) -> Response: ...
    async def rollout(self, job: str, rollout: str) -> Response: ...
    async def records(self, job: str, rollout: str, after: int, limit: int) -> Response: ...
    async def discard(self, job: str, rollout: str, from_step: int) -> dict[str, int]: ...


def trajectory_router(
    service: TrajectoryService | TrajectoryRemote, auth: Authenticator, access: JobAccess
) -> APIRouter:
    """Logging a step claims the job (dsec.control.jobs); reading or discarding needs
    ``runtime`` on the job's project."""
    caller = Depends(auth)  # a default, not an annotation: this module defers those
    router = APIRouter(
        prefix="/v1/trajectories",
        tags=["trajectories"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.post(
        "/{job_id}/{rollout_id}/steps",
        summary="Run or replay steps",
        responses={200: {"model": dict[str, list[StepAnswer]]}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {_JSON: {"schema": StepBatch.model_json_schema()}},
            }
        },
    )
    async def steps(
        request: Request, job_id: str, rollout_id: str, principal: str = caller
    ) -> Response:
        """Consecutive steps, handled in order as if sent one by one: a step that matches
        the log (number and content hash) is answered from it without touching the
        sandbox (`replayed: true`); the first that differs runs for real and the log
        after it is discarded. Stops after the first step that failed (its `error`)."""
        await access.claim(principal, check_name(job_id, "job id"), None, "logging steps")
        raw = await request.body()
        try:
            batch = StepBatch.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidArgument(f"bad steps: {_summary(exc)}") from None
        if not isinstance(service, TrajectoryService):
            return await service.steps(job_id, rollout_id, raw, batch)
        out = await service.run(job_id, rollout_id, batch.steps)
        body = '{"results":[' + ",".join(o.json() for o in out) + "]}"
        return Response(body, media_type=_JSON)

    @router.get(
        "/{job_id}",
        summary="A job's rollouts, or its whole log as JSONL",
        responses={200: {"model": list[TrajectoryInfo]}},
    )
    async def job(
        job_id: str,
        principal: str = caller,
        format: Annotated[str, Query(pattern="^(json|jsonl)$")] = "json",
        rollout_id: str | None = None,
    ) -> Response:
        """`format=jsonl`: every logged step (of `rollout_id` only, if given), one JSON
        object a line, in order; for auditing what an agent did."""
        await access.require(principal, check_name(job_id, "job id"), "reading a trajectory")
        if rollout_id is not None:
            check_name(rollout_id, "rollout id")
        if not isinstance(service, TrajectoryService):
            return await service.job(job_id, format, rollout_id)
        if format == "jsonl":
            return StreamingResponse(
                service.log.export(job_id, rollout_id), media_type="application/x-ndjson"
            )
        infos = service.log.infos(job_id, rollout_id)
        return Response("[" + ",".join(i.model_dump_json() for i in infos) + "]", media_type=_JSON)

    @router.get("/{job_id}/{rollout_id}", response_model=TrajectoryInfo, summary="One rollout")
    async def rollout(job_id: str, rollout_id: str, principal: str = caller) -> Response:
        await access.require(principal, check_name(job_id, "job id"), "reading a trajectory")
        if not isinstance(service, TrajectoryService):
            check_name(job_id, "job id")
            return await service.rollout(job_id, check_name(rollout_id, "rollout id"))
        infos = service.log.infos(check_name(job_id, "job id"), check_name(rollout_id, "rollout"))
        if not infos:
            raise NotFound(f"no trajectory {job_id}/{rollout_id}")
        return Response(infos[0].model_dump_json(), media_type=_JSON)

    @router.get(
        "/{job_id}/{rollout_id}/steps",
        response_model=list[StepRecord],
        summary="Logged steps of a rollout",
    )
    async def records(
        job_id: str,
        rollout_id: str,
        principal: str = caller,
        after: Annotated[int, Query(ge=-1, le=INT64_MAX)] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> Response:
        """Steps with a number greater than `after`, in order (page with the last one)."""
        await access.require(principal, check_name(job_id, "job id"), "reading a trajectory")
        if not isinstance(service, TrajectoryService):
            check_name(job_id, "job id")
            check_name(rollout_id, "rollout id")
            return await service.records(job_id, rollout_id, after, limit)
        recs = service.log.records(
            check_name(job_id, "job id"),
            check_name(rollout_id, "rollout id"),
            after=after,
            limit=limit,
        )
        return Response("[" + ",".join(r.model_dump_json() for r in recs) + "]", media_type=_JSON)

    @router.delete("/{job_id}/{rollout_id}", summary="Discard steps from a step on")
    async def discard(
        job_id: str,
        rollout_id: str,
        from_step: Annotated[int, Query(ge=0, le=INT64_MAX)],
        principal: str = caller,
    ) -> dict[str, int]:
        """Drop `from_step` and everything after it (e.g. an in-doubt step after a
        platform crash, once you checked the sandbox); the next run executes them."""
        await access.require(principal, check_name(job_id, "job id"), "discarding steps")
        if not isinstance(service, TrajectoryService):
            return await service.discard(job_id, rollout_id, from_step)
        return {"discarded": service.discard(job_id, rollout_id, from_step)}

    return router
