"""Job ownership (dsec.control.jobs): which project a job id belongs to.

Revision ID: 0005_jobs
Revises: 0004_cluster_keys
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_jobs"
down_revision: str | None = "0004_cluster_keys"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "iam_jobs",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("project", sa.String(512), nullable=False),
        sa.Column("principal", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("iam_jobs")
