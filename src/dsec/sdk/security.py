"""Events and audit methods of the SDK clients (``DSecClient`` / ``DSecSyncClient``).

After a rollout, a trainer asks whether the agent misbehaved::

    bad = await client.events(job="ppo-run-7", trajectory="t-42")
    if any(e.severity == "critical" for e in bad):
        reward = 0.0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from dsec.api.events import AuditKind, AuditRecord, EventKind, SecurityEvent
from dsec.sdk import _security as proto
from dsec.sdk._protocol import Call
from dsec.sdk._security import Page

T = TypeVar("T")


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class SecurityMixin:
    async def events(
        self: _AsyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[EventKind | str] | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[SecurityEvent]:
        """Misbehaviour events in order; pass the last ``seq`` as ``since_seq`` to page."""
        return await self._send(proto.events(job, sandbox, trajectory, kinds, since_seq, limit))

    async def audit(
        self: _AsyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[AuditKind | str] | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[AuditRecord]:
        """The audit log: commands, file operations, network decisions and events."""
        return await self._send(proto.audit(job, sandbox, trajectory, kinds, since_seq, limit))

    async def events_page(
        self: _AsyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[EventKind | str] | None = None,
        cursor: str = "",
        limit: int = 1000,
    ) -> Page[SecurityEvent]:
        """``events`` a page at a time, on one node or over a cluster's edges: pass the
        page's ``cursor`` back for the next one (rows written later come then)."""
        call = proto.events_page(job, sandbox, trajectory, kinds, cursor, limit)
        return await self._send(call)

    async def audit_page(
        self: _AsyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[AuditKind | str] | None = None,
        cursor: str = "",
        limit: int = 1000,
    ) -> Page[AuditRecord]:
        """``audit`` a page at a time; see ``events_page``."""
        return await self._send(proto.audit_page(job, sandbox, trajectory, kinds, cursor, limit))


class SyncSecurityMixin:
    def events(
        self: _SyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[EventKind | str] | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[SecurityEvent]:
        return self._send(proto.events(job, sandbox, trajectory, kinds, since_seq, limit))

    def audit(
        self: _SyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[AuditKind | str] | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[AuditRecord]:
        return self._send(proto.audit(job, sandbox, trajectory, kinds, since_seq, limit))

    def events_page(
        self: _SyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[EventKind | str] | None = None,
        cursor: str = "",
        limit: int = 1000,
    ) -> Page[SecurityEvent]:
        return self._send(proto.events_page(job, sandbox, trajectory, kinds, cursor, limit))

    def audit_page(
        self: _SyncSender,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[AuditKind | str] | None = None,
        cursor: str = "",
        limit: int = 1000,
    ) -> Page[AuditRecord]:
        return self._send(proto.audit_page(job, sandbox, trajectory, kinds, cursor, limit))
