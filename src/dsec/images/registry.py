"""The image registry: ``name:tag`` -> manifest, and the layers manifests refer to.

A manifest is small JSON, ``{"layers": [digest, ...bottom first], "config": {...}}``;
its digest is the SHA-256 of exactly the bytes stored here, so the same layers and
config always give the same image digest. Kept in the control-plane database (SQLite
or PostgreSQL) so every component sees the same names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import BigInteger, DateTime, String, Text, delete, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.control.db import Base


class ImageRow(Base):
    """One tag. Re-importing a tag replaces its manifest (like `docker tag`)."""

    __tablename__ = "images"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(80), nullable=False)
    manifest: Mapped[str] = mapped_column(Text, nullable=False)
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class LayerRow(Base):
    """A layer some image referenced once. ``source`` identifies the input it was built
    from (e.g. the digest of an uploaded archive) so an identical re-import reuses it;
    ``source_config`` is the image config that input declared."""

    __tablename__ = "image_layers"

    digest: Mapped[str] = mapped_column(String(80), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    source: Mapped[str | None] = mapped_column(String(200), index=True, nullable=True)
    source_config: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


TABLES = ("images", "image_layers")


@dataclass(frozen=True)
class NewLayer:
    digest: str
    size_bytes: int
    source: str | None = None
    source_config: str | None = None


def utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def manifest_layers(manifest: str) -> list[str]:
    doc = json.loads(manifest)
    layers = doc.get("layers") if isinstance(doc, dict) else None
    return [str(d) for d in layers] if isinstance(layers, list) else []


class Registry:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._sessions = async_sessionmaker(engine, class_=AsyncSession, expire_on_commit=False)

    async def create_tables(self) -> None:
        """Only our own tables: other components create theirs."""
        tables = [Base.metadata.tables[name] for name in TABLES]
        async with self.engine.begin() as conn:
            await conn.run_sync(lambda sync: Base.metadata.create_all(sync, tables=tables))

    async def get(self, name: str, tag: str) -> ImageRow | None:
        async with self._sessions() as s:
            return await s.get(ImageRow, (name, tag))

    async def all(self) -> list[ImageRow]:
        async with self._sessions() as s:
            rows = await s.scalars(select(ImageRow).order_by(ImageRow.name, ImageRow.tag))
            return list(rows)

    async def put(
        self,
        *,
        name: str,
        tag: str,
        digest: str,
        manifest: str,
        size_bytes: int,
        created_at: datetime,
        layers: list[NewLayer],
    ) -> tuple[ImageRow, bool]:
        """Insert or replace a tag and record its layers; returns (row, whether it
        replaced an earlier manifest)."""
        async with self._sessions() as s, s.begin():
            row = await s.get(ImageRow, (name, tag))
            replaced = row is not None
            if row is None:
                row = ImageRow(name=name, tag=tag)
                s.add(row)
            row.digest = digest
            row.manifest = manifest
            row.size_bytes = size_bytes
            row.created_at = created_at
            for layer in layers:
                known = await s.get(LayerRow, layer.digest)
                if known is None:
                    s.add(
                        LayerRow(
                            digest=layer.digest,
                            size_bytes=layer.size_bytes,
                            source=layer.source,
                            source_config=layer.source_config,
                            created_at=created_at,
                        )
                    )
                elif layer.source is not None and known.source is None:
                    known.source = layer.source
                    known.source_config = layer.source_config
        return row, replaced

    async def delete(self, name: str, tag: str) -> ImageRow | None:
        async with self._sessions() as s, s.begin():
            row = await s.get(ImageRow, (name, tag))
            if row is not None:
                await s.delete(row)
            return row

    async def referenced_layers(self) -> set[str]:
        async with self._sessions() as s:
            manifests = await s.scalars(select(ImageRow.manifest))
            return {d for m in manifests for d in manifest_layers(m)}

    async def layers(self) -> list[LayerRow]:
        async with self._sessions() as s:
            return list(await s.scalars(select(LayerRow)))

    async def layer_by_source(self, source: str) -> LayerRow | None:
        async with self._sessions() as s:
            rows = await s.scalars(
                select(LayerRow).where(LayerRow.source == source).order_by(LayerRow.created_at)
            )
            return rows.first()

    async def delete_layers(self, digests: list[str]) -> None:
        if not digests:
            return
        async with self._sessions() as s, s.begin():
            await s.execute(delete(LayerRow).where(LayerRow.digest.in_(digests)))
