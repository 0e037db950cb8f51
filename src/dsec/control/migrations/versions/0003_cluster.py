"""Cluster mode: edges (heartbeats, status) and the sandbox directory.

Revision ID: 0003_cluster
Revises: 0002_iam
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_cluster"
down_revision: str | None = "0002_iam"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "cluster_edges",
        sa.Column("edge_id", sa.String(16), primary_key=True),
        sa.Column("url", sa.String(256), nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("incarnation", sa.String(64), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("down_since", sa.Float(), nullable=True),
        sa.Column("down_reason", sa.String(1024), nullable=True),
        sa.Column("report", sa.JSON(), nullable=False),
    )
    op.create_table(
        "cluster_sandboxes",
        sa.Column("sandbox_id", sa.String(40), primary_key=True),
        sa.Column("edge_id", sa.String(16), nullable=False),
        sa.Column("job_id", sa.String(128), nullable=True),
        sa.Column("project", sa.String(512), nullable=True),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("info", sa.JSON(), nullable=False),
    )
    op.create_index("ix_cluster_sandboxes_job_id", "cluster_sandboxes", ["job_id"])
    op.create_index("ix_cluster_sandboxes_edge_state", "cluster_sandboxes", ["edge_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_cluster_sandboxes_edge_state", table_name="cluster_sandboxes")
    op.drop_index("ix_cluster_sandboxes_job_id", table_name="cluster_sandboxes")
    op.drop_table("cluster_sandboxes")
    op.drop_table("cluster_edges")
