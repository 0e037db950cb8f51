"""One SQLAlchemy metadata for all control-plane tables, SQLite or PostgreSQL.

The engine is async (aiosqlite / asyncpg) so the apiserver never blocks its loop on
the database. Table classes live next to the code that owns them and inherit ``Base``.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def make_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(url)
    if url.startswith("sqlite"):

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    return engine


async def create_all(engine: AsyncEngine) -> None:
    # Import the modules that declare tables so that they are registered on Base.
    from dsec.control import keys  # noqa: F401
    from dsec.images import registry  # noqa: F401

    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    return async_sessionmaker(engine, expire_on_commit=False)
