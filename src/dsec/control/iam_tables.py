"""The IAM tables (revision 0002_iam): principals, projects, role bindings, quotas, usage
and charges.

CPU is stored in integer millicores, not float cores: usage is a running sum of
charges and releases, and float sums drift (0.1 + 0.2 - 0.3 != 0), which would leave
usage forever inconsistent with the charges table. The API speaks cores.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from dsec.control.db import Base

PATH_LEN = 512  # PROJECT_RE: at most 8 segments of 63 characters
NAME_LEN = 128


class PrincipalRow(Base):
    __tablename__ = "iam_principals"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str | None] = mapped_column(String(NAME_LEN))
    default_project: Mapped[str | None] = mapped_column(String(PATH_LEN))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ProjectRow(Base):
    __tablename__ = "iam_projects"

    path: Mapped[str] = mapped_column(String(PATH_LEN), primary_key=True)
    parent: Mapped[str | None] = mapped_column(
        String(PATH_LEN), ForeignKey("iam_projects.path"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RoleBindingRow(Base):
    """One role of a principal on a project (or on ROOT, ``*``: every project)."""

    __tablename__ = "iam_role_bindings"

    principal: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    project: Mapped[str] = mapped_column(String(PATH_LEN), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str | None] = mapped_column(String(NAME_LEN))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class QuotaRow(Base):
    """NULL: no limit at this level (every ancestor's limit still applies)."""

    __tablename__ = "iam_quotas"

    project: Mapped[str] = mapped_column(
        String(PATH_LEN), ForeignKey("iam_projects.path", ondelete="CASCADE"), primary_key=True
    )
    max_sandboxes: Mapped[int | None] = mapped_column(Integer)
    cpu_millicores: Mapped[int | None] = mapped_column(BigInteger)
    memory_mb: Mapped[int | None] = mapped_column(BigInteger)


class UsageRow(Base):
    """What is charged to the project's subtree (the project itself and every
    descendant); one row per project, locked root first while charging."""

    __tablename__ = "iam_usage"

    project: Mapped[str] = mapped_column(
        String(PATH_LEN), ForeignKey("iam_projects.path", ondelete="CASCADE"), primary_key=True
    )
    sandboxes: Mapped[int] = mapped_column(BigInteger)
    cpu_millicores: Mapped[int] = mapped_column(BigInteger)
    memory_mb: Mapped[int] = mapped_column(BigInteger)


class ChargeRow(Base):
    """One live sandbox's charge; releasing deletes it (so release is idempotent)."""

    __tablename__ = "iam_charges"

    sandbox_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project: Mapped[str] = mapped_column(
        String(PATH_LEN), ForeignKey("iam_projects.path"), index=True
    )
    cpu_millicores: Mapped[int] = mapped_column(BigInteger)
    memory_mb: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class JobRow(Base):
    """Who a job belongs to (dsec.control.jobs): the project (and principal) that first
    used the job id, by a rollout, a sandbox, a trajectory or its model endpoint.
    Rows are never changed, so they may be cached forever."""

    __tablename__ = "iam_jobs"

    job_id: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    project: Mapped[str] = mapped_column(String(PATH_LEN))
    principal: Mapped[str] = mapped_column(String(NAME_LEN))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


IAM_TABLES = (
    PrincipalRow.__tablename__,
    ProjectRow.__tablename__,
    RoleBindingRow.__tablename__,
    QuotaRow.__tablename__,
    UsageRow.__tablename__,
    ChargeRow.__tablename__,
    JobRow.__tablename__,
)
