"""The hosted-rollout part of the HTTP protocol: requests and parsers, no I/O."""

from __future__ import annotations

from urllib.parse import quote

from pydantic import ValidationError

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
from dsec.errors import InvalidArgument
from dsec.sdk._protocol import _JSON_HEADERS, Call, _list_of, _model, invalid, wait_timeout

#: Seconds one wait request may last on the server (the SDK asks again).
WAIT_CHUNK = 60.0


def _rollout(rollout_id: str) -> str:
    if not rollout_id or "/" in rollout_id or len(rollout_id) > 128:
        raise InvalidArgument(f"invalid rollout id {rollout_id!r}")
    return "/v1/rollouts/" + quote(rollout_id, safe="")


def _job(job_id: str) -> str:
    if not job_id or "/" in job_id or len(job_id) > 128:
        raise InvalidArgument(f"invalid job id {job_id!r}: 1..128 chars, no '/'")
    return "/v1/jobs/" + quote(job_id, safe="")


def start_rollout(spec: RolloutSpec) -> Call[RolloutInfo]:
    return Call(
        "POST",
        "/v1/rollouts",
        _model(RolloutInfo),
        content=spec.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )


def get_rollout(rollout_id: str) -> Call[RolloutInfo]:
    return Call("GET", _rollout(rollout_id), _model(RolloutInfo))


def list_rollouts(job_id: str, state: RolloutState | str | None) -> Call[list[RolloutInfo]]:
    params = [("job_id", job_id)]
    if state is not None:
        params.append(("state", RolloutState(state).value))
    return Call("GET", "/v1/rollouts", _list_of(RolloutInfo), params=params)


def wait_rollout(rollout_id: str, timeout: float) -> Call[RolloutInfo]:
    chunk = max(0.1, min(timeout, WAIT_CHUNK))
    return Call(
        "POST",
        _rollout(rollout_id) + "/wait",
        _model(RolloutInfo),
        params=[("timeout", str(chunk))],
        timeout=wait_timeout(chunk),
    )


def cancel_rollout(rollout_id: str) -> Call[RolloutInfo]:
    return Call(
        "POST", _rollout(rollout_id) + "/cancel", _model(RolloutInfo), timeout=wait_timeout(60)
    )


def finished_rollouts(job_id: str, limit: int) -> Call[list[RolloutResult]]:
    return Call(
        "GET",
        _job(job_id) + "/rollouts/finished",
        _list_of(RolloutResult),
        params=[("limit", str(limit))],
    )


def ack_rollouts(job_id: str, ids: list[str]) -> Call[AckResult]:
    try:
        body = AckRequest(ids=list(ids))
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        _job(job_id) + "/rollouts/ack",
        _model(AckResult),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )


def set_model_endpoint(job_id: str, endpoint: ModelEndpoint) -> Call[EndpointSet]:
    return Call(
        "PUT",
        _job(job_id) + "/model-endpoint",
        _model(EndpointSet),
        content=endpoint.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )
