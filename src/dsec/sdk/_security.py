"""The events/audit part of the HTTP protocol (requests and parsers, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx

from dsec.api.events import AuditKind, AuditRecord, EventKind, SecurityEvent
from dsec.errors import InvalidArgument
from dsec.sdk._protocol import Call, _list_of

R = TypeVar("R", SecurityEvent, AuditRecord)
# A cursor that is one node's seq, unlike a cluster's "edge:seq,..." (edge ids are [a-z0-9]).
_SEQ = "@"


@dataclass(frozen=True, slots=True)
class Page(Generic[R]):
    """Rows of ``events_page``/``audit_page``. Pass ``cursor`` back for the next page:
    on one node it is the last ``seq``; through a cluster's apiserver it holds every
    edge's position (rows' ``seq`` are per edge). ``missing``: edges that did not answer
    (their rows come in a later page)."""

    items: list[R]
    cursor: str
    missing: list[str] = field(default_factory=list)


def _seq_of(cursor: str) -> int:
    """The seq of an ``@N`` cursor ('' = the start); anything else is a typed error."""
    text = cursor[1:] if cursor[:1] == _SEQ else cursor
    if cursor and (cursor[:1] != _SEQ or not text.isdigit() or len(text) > 18):
        raise InvalidArgument(f"bad cursor {cursor[:200]!r}: pass back a Page.cursor")
    return int(text or 0)


def _page_params(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[str] | None,
    cursor: str,
    limit: int,
) -> list[tuple[str, str]]:
    if not cursor or cursor.startswith(_SEQ):
        return _params(job, sandbox, trajectory, kinds, _seq_of(cursor), limit)
    return [*_params(job, sandbox, trajectory, kinds, 0, limit), ("cursor", cursor)]


def _page_of(cls: type[R], cursor: str) -> Callable[[httpx.Response], Page[R]]:
    rows = _list_of(cls)

    def parse(resp: httpx.Response) -> Page[R]:
        items = rows(resp)
        after = resp.headers.get("X-DSec-Cursor")
        if after is None:  # one node, or one sandbox's edge: a plain seq
            last = items[-1].seq if items else _seq_of(cursor) if cursor[:1] == _SEQ else 0
            after = f"{_SEQ}{last}"
        missing = resp.headers.get("X-DSec-Edges-Missing", "")
        return Page(items, after, [e for e in missing.split(",") if e])

    return parse


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


def events_page(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[EventKind | str] | None,
    cursor: str,
    limit: int,
) -> Call[Page[SecurityEvent]]:
    params = _page_params(job, sandbox, trajectory, kinds, cursor, limit)
    return Call("GET", "/v1/events", _page_of(SecurityEvent, cursor), params=params)


def audit_page(
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    kinds: Iterable[AuditKind | str] | None,
    cursor: str,
    limit: int,
) -> Call[Page[AuditRecord]]:
    params = _page_params(job, sandbox, trajectory, kinds, cursor, limit)
    return Call("GET", "/v1/audit", _page_of(AuditRecord, cursor), params=params)
