"""IAM methods of the SDK clients (``DSecClient`` / ``DSecSyncClient``).

An admin carves out a project for an RL job, caps it, and gives the job an agent key::

    await client.create_project("rl/math")
    await client.set_quota("rl/math", max_sandboxes=2000, cpu_cores=2000, memory_mb=2_000_000)
    await client.create_principal("math-runner", default_project="rl/math")
    await client.grant("math-runner", "runtime", project="rl/math")
    key = (await client.create_key("math-runner")).key
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from dsec.api.iam import (
    ROOT,
    KeyCreated,
    KeyInfo,
    PrincipalInfo,
    ProjectInfo,
    QuotaInfo,
    Role,
    RoleBinding,
)
from dsec.sdk import _iam as proto
from dsec.sdk._protocol import Call

T = TypeVar("T")


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class IAMMixin:
    async def create_project(self: _AsyncSender, path: str) -> ProjectInfo:
        """A project; a sub-project needs admin on its parent, a top-level one on the root."""
        return await self._send(proto.create_project(path))

    async def projects(self: _AsyncSender) -> list[ProjectInfo]:
        """The projects the caller holds some role on."""
        return await self._send(proto.projects())

    async def project(self: _AsyncSender, path: str) -> ProjectInfo:
        return await self._send(proto.project(path))

    async def delete_project(self: _AsyncSender, path: str) -> None:
        """Delete an empty project (no sub-projects, nothing charged)."""
        return await self._send(proto.delete_project(path))

    async def quota(self: _AsyncSender, path: str) -> QuotaInfo:
        """The project's limits and what its subtree uses."""
        return await self._send(proto.quota(path))

    async def set_quota(
        self: _AsyncSender,
        path: str,
        *,
        max_sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mb: int | None = None,
    ) -> QuotaInfo:
        """Replace the limits (None: no limit at this level); needs admin on the parent."""
        return await self._send(proto.set_quota(path, max_sandboxes, cpu_cores, memory_mb))

    async def roles(self: _AsyncSender, path: str = ROOT) -> list[RoleBinding]:
        """Who holds which role on ``path``, own and inherited (``*``: the root)."""
        return await self._send(proto.roles(path))

    async def grant(
        self: _AsyncSender, principal: str, role: Role | str, *, project: str = ROOT
    ) -> RoleBinding:
        """Bind ``role`` on ``project`` (default: the root); never above the caller's own."""
        return await self._send(proto.grant(project, principal, role))

    async def revoke(self: _AsyncSender, principal: str, *, project: str = ROOT) -> None:
        return await self._send(proto.revoke(project, principal))

    async def create_principal(
        self: _AsyncSender, name: str, *, kind: str = "agent", default_project: str | None = None
    ) -> PrincipalInfo:
        """A human or agent; it holds no role until granted one."""
        return await self._send(proto.create_principal(name, kind, default_project))

    async def principals(self: _AsyncSender) -> list[PrincipalInfo]:
        return await self._send(proto.principals())

    async def create_key(self: _AsyncSender, principal: str) -> KeyCreated:
        """A new API key for ``principal``; ``.key`` is shown this once only."""
        return await self._send(proto.create_key(principal))

    async def keys(self: _AsyncSender, principal: str | None = None) -> list[KeyInfo]:
        return await self._send(proto.keys(principal))

    async def revoke_key(self: _AsyncSender, key_id: str) -> KeyInfo:
        """Revoke by id (``KeyInfo.id``, at least 8 hex digits)."""
        return await self._send(proto.revoke_key(key_id))


class SyncIAMMixin:
    def create_project(self: _SyncSender, path: str) -> ProjectInfo:
        return self._send(proto.create_project(path))

    def projects(self: _SyncSender) -> list[ProjectInfo]:
        return self._send(proto.projects())

    def project(self: _SyncSender, path: str) -> ProjectInfo:
        return self._send(proto.project(path))

    def delete_project(self: _SyncSender, path: str) -> None:
        return self._send(proto.delete_project(path))

    def quota(self: _SyncSender, path: str) -> QuotaInfo:
        return self._send(proto.quota(path))

    def set_quota(
        self: _SyncSender,
        path: str,
        *,
        max_sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mb: int | None = None,
    ) -> QuotaInfo:
        return self._send(proto.set_quota(path, max_sandboxes, cpu_cores, memory_mb))

    def roles(self: _SyncSender, path: str = ROOT) -> list[RoleBinding]:
        return self._send(proto.roles(path))

    def grant(
        self: _SyncSender, principal: str, role: Role | str, *, project: str = ROOT
    ) -> RoleBinding:
        return self._send(proto.grant(project, principal, role))

    def revoke(self: _SyncSender, principal: str, *, project: str = ROOT) -> None:
        return self._send(proto.revoke(project, principal))

    def create_principal(
        self: _SyncSender, name: str, *, kind: str = "agent", default_project: str | None = None
    ) -> PrincipalInfo:
        return self._send(proto.create_principal(name, kind, default_project))

    def principals(self: _SyncSender) -> list[PrincipalInfo]:
        return self._send(proto.principals())

    def create_key(self: _SyncSender, principal: str) -> KeyCreated:
        return self._send(proto.create_key(principal))

    def keys(self: _SyncSender, principal: str | None = None) -> list[KeyInfo]:
        return self._send(proto.keys(principal))

    def revoke_key(self: _SyncSender, key_id: str) -> KeyInfo:
        return self._send(proto.revoke_key(key_id))
