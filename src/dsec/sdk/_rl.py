"""The RL part of the HTTP protocol (job pause/resume, pack_diff, fork, roles): requests
and parsers, no I/O."""

from __future__ import annotations

from urllib.parse import quote

from pydantic import ValidationError

from dsec.api.rl import (
    ForkRequest,
    ForkResult,
    JobPauseReport,
    JobResumeReport,
    PackedEnv,
    PackRequest,
)
from dsec.errors import InvalidArgument
from dsec.sdk._protocol import _JSON_HEADERS, Call, _model, invalid, sandbox_path, wait_timeout


def _job(job_id: str) -> str:
    if not job_id or "/" in job_id or len(job_id) > 128:
        raise InvalidArgument(f"invalid job id {job_id!r}: 1..128 chars, no '/'")
    return "/v1/jobs/" + quote(job_id, safe="")


def pause_job(job_id: str) -> Call[JobPauseReport]:
    return Call("POST", _job(job_id) + "/pause", _model(JobPauseReport), timeout=wait_timeout(600))


def resume_job(job_id: str) -> Call[JobResumeReport]:
    return Call("POST", _job(job_id) + "/resume", _model(JobResumeReport))


def pack_diff(sandbox_id: str, name: str, version: str) -> Call[PackedEnv]:
    try:
        body = PackRequest(name=name, version=version)
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        sandbox_path(sandbox_id) + "/pack",
        _model(PackedEnv),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(600),
    )


def fork(
    sandbox_id: str, n: int, name: str | None, version: str | None, timeout: float
) -> Call[ForkResult]:
    try:
        body = ForkRequest(n=n, name=name, version=version, timeout=timeout)
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        sandbox_path(sandbox_id) + "/fork",
        _model(ForkResult),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(600 + timeout),
    )


def _role_path(principal: str, role: str) -> str:
    return f"/v1/roles/{quote(principal, safe='')}/{quote(role, safe='')}"


def grant_role(principal: str, role: str) -> Call[None]:
    return Call("PUT", _role_path(principal, role), lambda _r: None)


def revoke_role(principal: str, role: str) -> Call[None]:
    return Call("DELETE", _role_path(principal, role), lambda _r: None)
