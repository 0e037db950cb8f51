"""IAM on the wire: projects, principals, keys, roles and quotas.

The bodies and answers of /v1/projects, /v1/principals and /v1/keys, shared by the
apiserver and the SDK.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field

from dsec.api.base import Reply, Strict
from dsec.api.fields import PROJECT_RE

# A new principal's name: safe in URLs, logs and the CLI. Keys made before IAM may name
# any principal; those keep working, only creation through /v1/principals is strict.
PRINCIPAL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")


# Bindings on ROOT hold on every project (the bootstrap ``admin`` is admin there).
ROOT = "*"


class Role(StrEnum):
    """Ordered: each role may do everything the ones below it may."""

    RUNTIME = "runtime"
    BUILDER = "builder"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Role.RUNTIME: 1, Role.BUILDER: 2, Role.ADMIN: 3}


class ProjectCreate(Strict):
    path: str = Field(pattern=PROJECT_RE.pattern, description="e.g. 'rl/math'; parent must exist")


class ProjectInfo(Reply):
    path: str
    parent: str | None
    created_at: datetime


class QuotaLimits(Strict):
    """A project's limits; None: unlimited here (still bounded by every ancestor)."""

    max_sandboxes: int | None = Field(None, ge=0, le=10_000_000)
    cpu_cores: float | None = Field(None, ge=0, le=10_000_000)
    memory_mb: int | None = Field(None, ge=0, le=1 << 40)


class QuotaUsage(Reply):
    sandboxes: int
    cpu_cores: float
    memory_mb: int


class QuotaInfo(Reply):
    project: str
    limits: QuotaLimits
    usage: QuotaUsage
    warnings: list[str] = Field(
        default_factory=list,
        description="e.g. a limit set below current usage: nothing is stopped, new "
        "sandboxes are refused until usage falls below it",
    )


class PrincipalCreate(Strict):
    name: str = Field(pattern=PRINCIPAL_RE.pattern)
    kind: Literal["human", "agent"] = "agent"
    default_project: str | None = Field(
        None, pattern=PROJECT_RE.pattern, description="charged when a create names no project"
    )


class PrincipalInfo(Reply):
    name: str
    kind: str
    created_by: str | None
    default_project: str | None
    created_at: datetime


class KeyCreate(Strict):
    principal: str = Field(min_length=1, max_length=128)


class KeyInfo(Reply):
    id: str = Field(
        description="first 16 hex digits of the key's SHA-256; the key itself is never stored"
    )
    principal: str
    created_at: datetime


class KeyCreated(KeyInfo):
    key: str = Field(description="the plain key; shown once")


class RoleGrant(Strict):
    principal: str = Field(min_length=1, max_length=128)
    role: Role


class RoleBinding(Reply):
    principal: str
    project: str
    role: Role
    inherited_from: str | None = Field(
        None, description="the ancestor the binding is on, when listed for a descendant"
    )
