"""Roles of principals, the API from before nested projects, now a view of IAM.

A key authenticates a principal (dsec.control.keys); a role says what it may do
(DSEC.md §6.1): ``builder`` may turn a sandbox into a layer (pack_diff, fork), a
rollout's ``runtime`` key may not. Roles now live in dsec.control.iam, bound to
projects. This store keeps the earlier, project-less calls working with one meaning:

- ``grant(principal, role)`` / ``revoke`` bind on ROOT (``*``: every project);
- ``roles(principal)`` are the roles held on ROOT;
- ``require(principal, role, action, project=P)`` checks ``role`` on P (own or
  inherited); without P it checks ROOT.

The ``principal_roles`` table stays (baseline schema); its rows are copied into IAM as
ROOT bindings once at bootstrap.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, String
from sqlalchemy.orm import Mapped, mapped_column

from dsec.control.db import Base
from dsec.control.iam import ADMIN, IAM, ROOT, Role, _role

__all__ = ["ADMIN", "Role", "RoleStore"]


class PrincipalRoleRow(Base):
    """The pre-IAM grants (read once by IAM.ensure_bootstrap)."""

    __tablename__ = "principal_roles"

    principal: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RoleStore:
    def __init__(self, iam: IAM) -> None:
        self.iam = iam

    async def create_tables(self) -> None:
        await self.iam.create_tables()

    async def grant(self, principal: str, role: Role | str, *, caller: str = ADMIN) -> None:
        """Bind on ROOT; registers a principal known only by its keys."""
        await self.iam.grant(caller, principal, ROOT, _role(role), create=True)

    async def revoke(self, principal: str, role: Role | str, *, caller: str = ADMIN) -> bool:
        role = _role(role)
        if await self.iam.role_on(principal, ROOT) is not role:
            return False
        return await self.iam.revoke(caller, principal, ROOT)

    async def roles(self, principal: str) -> frozenset[str]:
        held = await self.iam.role_on(principal, ROOT)
        if held is None:
            return frozenset()
        return frozenset(r.value for r in Role if r.rank <= held.rank)

    async def require(
        self, principal: str, role: Role, action: str, *, project: str = ROOT
    ) -> None:
        """Raise PermissionDenied (403) unless ``principal`` holds ``role`` on
        ``project`` (see the module doc)."""
        await self.iam.require(principal, role, project, action)
