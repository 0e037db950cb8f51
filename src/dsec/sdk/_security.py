"""The events/audit part of the HTTP protocol (requests and parsers, no I/O)."""

from __future__ import annotations

from collections.abc import Iterable

from dsec.sdk._protocol import Call, _list_of
from dsec.security.events import AuditKind, AuditRecord, EventKind, SecurityEvent


def _params(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[str] | None,
    since_seq: int,
    limit: int,
) -> list[tuple[str, str]]:
    params = [("since_seq", str(since_seq)), ("limit", str(limit))]
    for key, value in (("job_id", job), ("sandbox_id", sandbox), ("trajectory_id", trajectory)):
        if value is not None:
            params.append((key, value))
    params.extend(("kind", str(k)) for k in kinds or ())
    return params


def events(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[EventKind | str] | None,
    since_seq: int,
    limit: int,
) -> Call[list[SecurityEvent]]:
    params = _params(job, sandbox, trajectory, kinds, since_seq, limit)
    return Call("GET", "/v1/events", _list_of(SecurityEvent), params=params)


def audit(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[AuditKind | str] | None,
    since_seq: int,
    limit: int,
) -> Call[list[AuditRecord]]:
    params = _params(job, sandbox, trajectory, kinds, since_seq, limit)
    return Call("GET", "/v1/audit", _list_of(AuditRecord), params=params)
