"""Who may do what to which sandbox: the one check every sandbox-scoped route goes through.

A sandbox belongs to the project in its spec (sandboxes from before IAM: the default
project). Using it (inspect, exec, files, sessions, PTY, streams, verify, network, live
view, desktop, data-path tokens) needs ``runtime`` there; pack and fork need
``builder``. A caller with no role at all on the sandbox's project is answered exactly
as for an id that does not exist (SandboxNotFound, 404), so ids of other tenants
cannot be probed; one who may see the sandbox but lacks a higher role gets a 403.
Lists are filtered to the projects the caller holds a role on.

Routes take the check as a FastAPI dependency (``SandboxAccess.runtime`` and
``.builder`` read the ``{sandbox_id}`` path parameter), so a route cannot forget it
without tests/test_sandbox_access.py noticing. Without IAM (single-user ``dsec up``,
and a cluster edge, whose only key is the cluster token) every check passes.

The project of a sandbox never changes, so it is remembered (bounded): on a cluster
apiserver the check costs one edge round trip per sandbox, not per request.
"""

# No `from __future__ import annotations`: FastAPI must see the dependency signatures.
from collections.abc import Iterable
from typing import Annotated, Protocol

from fastapi import Depends

from dsec.api.iam import Role
from dsec.api.sandbox import SandboxInfo
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.params import check_sandbox_id
from dsec.control.iam import IAM, ROOT
from dsec.errors import PermissionDenied, SandboxNotFound

#: Sandbox -> project entries kept; cleared whole when full (projects never change).
CACHE_MAX = 65536


class SandboxLookup(Protocol):
    """Where a sandbox's record is read (an Edge, a cluster's router)."""

    async def get(self, sandbox_id: str) -> SandboxInfo: ...


def hidden(sandbox_id: str) -> SandboxNotFound:
    """What a sandbox of a project the caller may not use looks like: not there, word
    for word as its edge answers for an id it does not hold (dsec.edge.edge)."""
    edge_id = sandbox_id.split("-", 1)[0]
    return SandboxNotFound(f"no sandbox {sandbox_id!r} on edge {edge_id}", sandbox_id=sandbox_id)


class SandboxAccess:
    """Decides "may principal P do action A on sandbox S" for every route."""

    def __init__(self, edge: SandboxLookup, iam: IAM | None, auth: Authenticator) -> None:
        self.edge = edge
        self.iam = iam
        self.auth = auth
        self._projects: dict[str, str] = {}
        Principal = Annotated[str, Depends(auth)]

        async def runtime(sandbox_id: str, principal: Principal) -> str:
            """Dependency: the path's sandbox, which the caller may use."""
            return await self.require(principal, sandbox_id)

        async def builder(sandbox_id: str, principal: Principal) -> str:
            """Dependency: the path's sandbox, which the caller may pack or fork."""
            return await self.require(principal, sandbox_id, Role.BUILDER, "packing or forking")

        self.runtime = runtime
        self.builder = builder

    @property
    def enforced(self) -> bool:
        return self.iam is not None

    async def sees_all(self, principal: str, role: Role = Role.RUNTIME) -> bool:
        """Whether ``principal`` holds ``role`` on every project (or there is no IAM)."""
        iam = self.iam
        if iam is None:
            return True
        held = await iam.role_on(principal, ROOT)
        return held is not None and held.rank >= role.rank

    async def project_of(self, sandbox_id: str) -> str:
        """The sandbox's project; SandboxNotFound if there is no such sandbox."""
        hit = self._projects.get(sandbox_id)
        if hit is not None:
            return hit
        return self.remember(await self.edge.get(sandbox_id))

    def remember(self, info: SandboxInfo) -> str:
        """Note the project of a sandbox seen elsewhere (a list, a create)."""
        assert self.iam is not None
        project = info.spec.project or self.iam.default
        if len(self._projects) >= CACHE_MAX:
            self._projects.clear()
        self._projects[info.id] = project
        return project

    async def require(
        self,
        principal: str,
        sandbox_id: str,
        role: Role = Role.RUNTIME,
        action: str = "using a sandbox",
    ) -> str:
        """The checked sandbox id if ``principal`` may do ``action`` on it; else
        SandboxNotFound (no role on its project) or PermissionDenied (a lower role)."""
        sid = check_sandbox_id(sandbox_id)
        iam = self.iam
        if iam is None or await self.sees_all(principal, role):
            return sid
        project = await self.project_of(sid)
        held = await iam.role_on(principal, project)
        if held is None:
            raise hidden(sid)
        if held.rank < role.rank:
            raise PermissionDenied(
                f"{action} needs the {role.value!r} role on project {project!r}; "
                f"principal {principal!r} has {held.value} there",
                principal=principal,
                role=role.value,
                project=project,
            )
        return sid

    async def may_use(self, principal: str, info: SandboxInfo) -> bool:
        """Whether ``principal`` holds ``runtime`` on the project of ``info``."""
        iam = self.iam
        if iam is None:
            return True
        return await iam.role_on(principal, self.remember(info)) is not None

    async def visible(self, principal: str, items: Iterable[SandboxInfo]) -> list[SandboxInfo]:
        """The sandboxes of ``items`` on projects the caller holds a role on."""
        if await self.sees_all(principal):
            return list(items)
        return [info for info in items if await self.may_use(principal, info)]
