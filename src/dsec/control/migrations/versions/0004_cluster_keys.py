"""Cluster mode: Idempotency-Key pins (dsec.cluster.keys).

Revision ID: 0004_cluster_keys
Revises: 0003_cluster
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_cluster_keys"
down_revision: str | None = "0003_cluster"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "cluster_create_keys",
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("edge_id", sa.String(16), nullable=False),
        sa.Column("sandbox_id", sa.String(40), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_cluster_create_keys_expires_at", "cluster_create_keys", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_cluster_create_keys_expires_at", table_name="cluster_create_keys")
    op.drop_table("cluster_create_keys")
