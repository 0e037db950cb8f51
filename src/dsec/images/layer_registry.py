"""The layer registry: ``name:version`` -> layer blob, in the control-plane database.

Next to the image tags (dsec.images.registry) but separate, so a workspace or toolkit
layer can be versioned on its own and stacked on any base. ``layer_indexes`` records
the digest of each blob's chunk index, which is what makes lazily fetched chunks
verifiable: an index is trusted only if it hashes to the digest recorded here.
"""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Integer, String, Text, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.api.layers import LayerInfo
from dsec.control.db import Base
from dsec.images.registry import utc


class LayerTagRow(Base):
    __tablename__ = "layer_tags"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(80), nullable=False, index=True)
    index_digest: Mapped[str | None] = mapped_column(String(80), nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    config: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str | None] = mapped_column(String(400), nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class LayerIndexRow(Base):
    __tablename__ = "layer_indexes"

    digest: Mapped[str] = mapped_column(String(80), primary_key=True)
    index_digest: Mapped[str] = mapped_column(String(80), nullable=False)
    chunk_size: Mapped[int] = mapped_column(Integer, nullable=False)


TABLES = ("layer_tags", "layer_indexes")


def to_info(row: LayerTagRow) -> LayerInfo:
    config = json.loads(row.config) if row.config else None
    return LayerInfo(
        name=row.name,
        version=row.version,
        digest=row.digest,
        index_digest=row.index_digest,
        size_bytes=row.size_bytes,
        kind=row.kind,
        config=config if isinstance(config, dict) else None,
        source=row.source,
        created_at=utc(row.created_at),
    )


class LayerRegistry:
    def __init__(self, engine: AsyncEngine) -> None:
        self._sessions = async_sessionmaker(engine, class_=AsyncSession, expire_on_commit=False)
        self.engine = engine

    async def create_tables(self) -> None:
        tables = [Base.metadata.tables[name] for name in TABLES]
        async with self.engine.begin() as conn:
            await conn.run_sync(lambda sync: Base.metadata.create_all(sync, tables=tables))

    async def get(self, name: str, version: str) -> LayerInfo | None:
        async with self._sessions() as s:
            row = await s.get(LayerTagRow, (name, version))
            return to_info(row) if row is not None else None

    async def all(self) -> list[LayerInfo]:
        async with self._sessions() as s:
            rows = await s.scalars(
                select(LayerTagRow).order_by(LayerTagRow.name, LayerTagRow.version)
            )
            return [to_info(r) for r in rows]

    async def by_source(self, source: str) -> LayerInfo | None:
        async with self._sessions() as s:
            rows = await s.scalars(select(LayerTagRow).where(LayerTagRow.source == source))
            row = rows.first()
            return to_info(row) if row is not None else None

    async def put(self, info: LayerInfo) -> LayerInfo | None:
        """Insert or replace a tag; returns what it pointed at before, if anything."""
        async with self._sessions() as s, s.begin():
            row = await s.get(LayerTagRow, (info.name, info.version))
            before = to_info(row) if row is not None else None
            if row is None:
                row = LayerTagRow(name=info.name, version=info.version)
                s.add(row)
            row.digest = info.digest
            row.index_digest = info.index_digest
            row.size_bytes = info.size_bytes
            row.kind = info.kind
            row.config = json.dumps(info.config, sort_keys=True) if info.config else None
            row.source = info.source
            row.created_at = info.created_at
            if info.index_digest is not None:
                await self._put_index(s, info.digest, info.index_digest, None)
        return before

    async def delete(self, name: str, version: str) -> LayerInfo | None:
        async with self._sessions() as s, s.begin():
            row = await s.get(LayerTagRow, (name, version))
            if row is None:
                return None
            info = to_info(row)
            await s.delete(row)
            return info

    async def referenced(self) -> set[str]:
        async with self._sessions() as s:
            return set(await s.scalars(select(LayerTagRow.digest)))

    async def indexes(self) -> dict[str, str]:
        async with self._sessions() as s:
            rows = await s.scalars(select(LayerIndexRow))
            return {r.digest: r.index_digest for r in rows}

    async def put_index(self, digest: str, index_digest: str, chunk_size: int) -> None:
        async with self._sessions() as s, s.begin():
            await self._put_index(s, digest, index_digest, chunk_size)

    @staticmethod
    async def _put_index(
        s: AsyncSession, digest: str, index_digest: str, chunk_size: int | None
    ) -> None:
        row = await s.get(LayerIndexRow, digest)
        if row is None:
            s.add(
                LayerIndexRow(digest=digest, index_digest=index_digest, chunk_size=chunk_size or 0)
            )
        else:
            row.index_digest = index_digest
            if chunk_size:
                row.chunk_size = chunk_size
