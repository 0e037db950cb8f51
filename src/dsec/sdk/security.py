"""Events and audit methods of the SDK clients (``DSecClient`` / ``DSecSyncClient``).

After a rollout, a trainer asks whether the agent misbehaved::

    bad = await client.events(job="ppo-run-7", trajectory="t-42")
    if any(e.severity == "critical" for e in bad):
        reward = 0.0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from dsec.sdk import _security as proto
from dsec.sdk._protocol import Call
from dsec.security.events import AuditKind, AuditRecord, EventKind, SecurityEvent

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
