"""Baseline: every table that existed before migrations (keys, roles, image registry).

Revision ID: 0001_baseline
Revises: (none)

Databases made by ``dsec up`` before migrations existed already hold some of these
tables (created by ``Base.metadata.create_all`` piecemeal, by whichever component ran):
``dsec.control.db.migrate`` recognises such a database and adopts it at this revision,
creating only the tables it lacks, so no row is touched.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_baseline"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

TABLES = (
    "api_keys",
    "principal_roles",
    "images",
    "image_layers",
    "layer_tags",
    "layer_indexes",
)


def _create(name: str) -> None:
    when = sa.DateTime(timezone=True)
    if name == "api_keys":
        op.create_table(
            "api_keys",
            sa.Column("key_hash", sa.String(64), primary_key=True),
            sa.Column("principal", sa.String(128), nullable=False),
            sa.Column("created_at", when, nullable=False),
        )
        op.create_index("ix_api_keys_principal", "api_keys", ["principal"])
    elif name == "principal_roles":
        op.create_table(
            "principal_roles",
            sa.Column("principal", sa.String(128), primary_key=True),
            sa.Column("role", sa.String(32), primary_key=True),
            sa.Column("created_at", when, nullable=False),
        )
    elif name == "images":
        op.create_table(
            "images",
            sa.Column("name", sa.String(128), primary_key=True),
            sa.Column("tag", sa.String(128), primary_key=True),
            sa.Column("digest", sa.String(80), nullable=False),
            sa.Column("manifest", sa.Text(), nullable=False),
            sa.Column("size_bytes", sa.BigInteger(), nullable=False),
            sa.Column("created_at", when, nullable=False),
        )
    elif name == "image_layers":
        op.create_table(
            "image_layers",
            sa.Column("digest", sa.String(80), primary_key=True),
            sa.Column("size_bytes", sa.BigInteger(), nullable=False),
            sa.Column("source", sa.String(200), nullable=True),
            sa.Column("source_config", sa.Text(), nullable=True),
            sa.Column("created_at", when, nullable=False),
        )
        op.create_index("ix_image_layers_source", "image_layers", ["source"])
    elif name == "layer_tags":
        op.create_table(
            "layer_tags",
            sa.Column("name", sa.String(128), primary_key=True),
            sa.Column("version", sa.String(128), primary_key=True),
            sa.Column("digest", sa.String(80), nullable=False),
            sa.Column("index_digest", sa.String(80), nullable=True),
            sa.Column("size_bytes", sa.BigInteger(), nullable=False),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("config", sa.Text(), nullable=True),
            sa.Column("source", sa.String(400), nullable=True),
            sa.Column("created_at", when, nullable=False),
        )
        op.create_index("ix_layer_tags_digest", "layer_tags", ["digest"])
        op.create_index("ix_layer_tags_source", "layer_tags", ["source"])
    elif name == "layer_indexes":
        op.create_table(
            "layer_indexes",
            sa.Column("digest", sa.String(80), primary_key=True),
            sa.Column("index_digest", sa.String(80), nullable=False),
            sa.Column("chunk_size", sa.Integer(), nullable=False),
        )
    else:  # pragma: no cover - TABLES and this function change together
        raise AssertionError(name)


def upgrade() -> None:
    # Only what is missing: a pre-migration database keeps its tables and rows.
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    for name in TABLES:
        if name not in existing:
            _create(name)


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)
