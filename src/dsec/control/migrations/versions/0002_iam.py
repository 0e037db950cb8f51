"""IAM: principals, nested projects, role bindings, quotas, usage and charges.

Revision ID: 0002_iam
Revises: 0001_baseline

Tables of dsec.control.iam_tables. The bootstrap rows (project ``default``, principal
``admin`` admin on the root) are made by ``IAM.ensure_bootstrap`` at start, not here,
so the default project's name stays configurable.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_iam"
down_revision: str | None = "0001_baseline"
branch_labels: str | None = None
depends_on: str | None = None

PATH = 512
NAME = 128


def upgrade() -> None:
    when = sa.DateTime(timezone=True)
    op.create_table(
        "iam_principals",
        sa.Column("name", sa.String(NAME), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("created_by", sa.String(NAME), nullable=True),
        sa.Column("default_project", sa.String(PATH), nullable=True),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_table(
        "iam_projects",
        sa.Column("path", sa.String(PATH), primary_key=True),
        sa.Column("parent", sa.String(PATH), sa.ForeignKey("iam_projects.path"), nullable=True),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_index("ix_iam_projects_parent", "iam_projects", ["parent"])
    op.create_table(
        "iam_role_bindings",
        sa.Column("principal", sa.String(NAME), primary_key=True),
        sa.Column("project", sa.String(PATH), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_by", sa.String(NAME), nullable=True),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_index("ix_iam_role_bindings_project", "iam_role_bindings", ["project"])
    op.create_table(
        "iam_quotas",
        sa.Column(
            "project",
            sa.String(PATH),
            sa.ForeignKey("iam_projects.path", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("max_sandboxes", sa.Integer(), nullable=True),
        sa.Column("cpu_millicores", sa.BigInteger(), nullable=True),
        sa.Column("memory_mb", sa.BigInteger(), nullable=True),
    )
    op.create_table(
        "iam_usage",
        sa.Column(
            "project",
            sa.String(PATH),
            sa.ForeignKey("iam_projects.path", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("cpu_millicores", sa.BigInteger(), nullable=False),
        sa.Column("memory_mb", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "iam_charges",
        sa.Column("sandbox_id", sa.String(64), primary_key=True),
        sa.Column("project", sa.String(PATH), sa.ForeignKey("iam_projects.path"), nullable=False),
        sa.Column("cpu_millicores", sa.BigInteger(), nullable=False),
        sa.Column("memory_mb", sa.BigInteger(), nullable=False),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_index("ix_iam_charges_project", "iam_charges", ["project"])


def downgrade() -> None:
    op.drop_index("ix_iam_charges_project", table_name="iam_charges")
    op.drop_table("iam_charges")
    op.drop_table("iam_usage")
    op.drop_table("iam_quotas")
    op.drop_index("ix_iam_role_bindings_project", table_name="iam_role_bindings")
    op.drop_table("iam_role_bindings")
    op.drop_index("ix_iam_projects_parent", table_name="iam_projects")
    op.drop_table("iam_projects")
    op.drop_table("iam_principals")
