"""Roles of principals: builder/runtime separation (DSEC.md §6.1).

A key authenticates a principal (dsec.control.keys); a role says what it may do beyond
running sandboxes. ``builder`` may turn a sandbox into a layer (pack_diff, fork): a
rollout's runtime key must not be able to publish environments other jobs start from.
The bootstrap principal ``admin`` holds every role. Grants live in the control
database beside the keys and are cached in memory (pack is rare, but the check is on
its path); a grant or revoke through this instance takes effect at once.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import DateTime, String, delete, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.control.db import Base
from dsec.errors import InvalidArgument, PermissionDenied

ADMIN = "admin"


class Role(StrEnum):
    BUILDER = "builder"


class PrincipalRoleRow(Base):
    __tablename__ = "principal_roles"

    principal: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RoleStore:
    def __init__(self, engine: AsyncEngine, *, cache_ttl: float = 60.0) -> None:
        self._engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self._cache_ttl = cache_ttl
        self._cache: dict[str, tuple[frozenset[str], float]] = {}

    async def create_tables(self) -> None:
        table = Base.metadata.tables[PrincipalRoleRow.__tablename__]
        async with self._engine.begin() as conn:
            await conn.run_sync(lambda sync: Base.metadata.create_all(sync, tables=[table]))

    async def grant(self, principal: str, role: Role | str) -> None:
        role = _role(role)
        async with self._sessions() as s, s.begin():
            if await s.get(PrincipalRoleRow, (principal, role.value)) is None:
                s.add(
                    PrincipalRoleRow(
                        principal=principal, role=role.value, created_at=datetime.now(UTC)
                    )
                )
        self._cache.pop(principal, None)

    async def revoke(self, principal: str, role: Role | str) -> bool:
        role = _role(role)
        async with self._sessions() as s, s.begin():
            res = await s.execute(
                delete(PrincipalRoleRow).where(
                    PrincipalRoleRow.principal == principal, PrincipalRoleRow.role == role.value
                )
            )
        self._cache.pop(principal, None)
        return bool(getattr(res, "rowcount", 0))

    async def roles(self, principal: str) -> frozenset[str]:
        if principal == ADMIN:
            return frozenset(r.value for r in Role)
        hit = self._cache.get(principal)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        async with self._sessions() as s:
            rows = await s.scalars(
                select(PrincipalRoleRow.role).where(PrincipalRoleRow.principal == principal)
            )
            found = frozenset(rows)
        self._cache[principal] = (found, now + self._cache_ttl)
        return found

    async def require(self, principal: str, role: Role, action: str) -> None:
        """Raise PermissionDenied (403) unless ``principal`` holds ``role``."""
        if role.value not in await self.roles(principal):
            raise PermissionDenied(
                f"{action} needs the {role.value!r} role; principal {principal!r} does not "
                "have it (an admin grants it: RoleStore.grant / `dsec role grant`)",
                principal=principal,
                role=role.value,
            )


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidArgument(
            f"unknown role {role!r}; known roles: {', '.join(r.value for r in Role)}"
        ) from None
