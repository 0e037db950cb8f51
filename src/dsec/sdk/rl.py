"""RL co-design methods of the SDK: job pause/resume on the clients, pack_diff and fork
on the sandbox handles (async and sync).

    report = await client.pause_job("job-42")      # frozen, memory reclaimed
    await client.resume_job("job-42")              # or just use a sandbox: it thaws
    env = await sb.pack_diff(name="task-env", version="v1")   # builder role
    child = await client.run_container(env.run_args(memory_limit_mb=256))
    children = await sb.fork(4)                    # pack_diff + 4 sandboxes
"""

from __future__ import annotations

from typing import Any, Protocol, Self, TypeVar

from dsec.api.rl import JobPauseReport, JobResumeReport, PackedEnv
from dsec.api.sandbox import SandboxInfo
from dsec.sdk import _rl as proto
from dsec.sdk._protocol import Call

T = TypeVar("T")


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class JobsMixin:
    async def pause_job(self: _AsyncSender, job_id: str) -> JobPauseReport:
        """Freeze every running sandbox of ``job_id`` (spec ``job_id``) and reclaim its
        memory; all state is kept. Reports sandboxes paused, bytes reclaimed, time."""
        return await self._send(proto.pause_job(job_id))

    async def resume_job(self: _AsyncSender, job_id: str) -> JobResumeReport:
        """Thaw the job's paused sandboxes (a request to one thaws it anyway)."""
        return await self._send(proto.resume_job(job_id))

    async def grant_role(self: _AsyncSender, principal: str, role: str) -> None:
        """Admin only: e.g. ``grant_role("ci-builder", "builder")`` allows pack_diff/fork."""
        await self._send(proto.grant_role(principal, role))

    async def revoke_role(self: _AsyncSender, principal: str, role: str) -> None:
        await self._send(proto.revoke_role(principal, role))


class SyncJobsMixin:
    def pause_job(self: _SyncSender, job_id: str) -> JobPauseReport:
        return self._send(proto.pause_job(job_id))

    def resume_job(self: _SyncSender, job_id: str) -> JobResumeReport:
        return self._send(proto.resume_job(job_id))

    def grant_role(self: _SyncSender, principal: str, role: str) -> None:
        self._send(proto.grant_role(principal, role))

    def revoke_role(self: _SyncSender, principal: str, role: str) -> None:
        self._send(proto.revoke_role(principal, role))


class SandboxRLMixin:
    _client: Any
    info: SandboxInfo

    async def pack_diff(self, name: str, version: str = "latest") -> PackedEnv:
        """This sandbox's changes (files written, deleted, chmod-ed) as layer
        ``name:version``; needs the builder role. Start sandboxes from it with
        ``env.run_args()``. The sandbox is frozen while it is read, then goes on."""
        return await self._client._send(proto.pack_diff(self.info.id, name, version))  # type: ignore[no-any-return]

    async def fork(
        self,
        n: int,
        *,
        name: str | None = None,
        version: str | None = None,
        timeout: float = 120.0,
    ) -> list[Self]:
        """pack_diff + ``n`` new sandboxes from it: each sees this sandbox's files as
        they are now; their later changes are their own."""
        res = await self._client._send(proto.fork(self.info.id, n, name, version, timeout))
        return [type(self)(self._client, info) for info in res.children]  # type: ignore[call-arg]


class SyncSandboxRLMixin:
    _client: Any
    info: SandboxInfo

    def pack_diff(self, name: str, version: str = "latest") -> PackedEnv:
        return self._client._send(proto.pack_diff(self.info.id, name, version))  # type: ignore[no-any-return]

    def fork(
        self,
        n: int,
        *,
        name: str | None = None,
        version: str | None = None,
        timeout: float = 120.0,
    ) -> list[Self]:
        res = self._client._send(proto.fork(self.info.id, n, name, version, timeout))
        return [type(self)(self._client, info) for info in res.children]  # type: ignore[call-arg]
