"""One SQLAlchemy metadata for all control-plane tables, SQLite or PostgreSQL.

The engine is async (aiosqlite / asyncpg) so the apiserver never blocks its loop on
the database. Table classes live next to the code that owns them and inherit ``Base``.
The schema is versioned with Alembic (``dsec.control.migrations``; env.py says how to
add a revision): ``migrate(engine)`` brings any database to head.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, event, inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from dsec.errors import DatabaseUnavailable, InvalidArgument

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
BASELINE = "0001_baseline"
VERSION_TABLE = "alembic_version"
# Every module that declares tables on Base; optional ones may not exist yet.
MODEL_MODULES = (
    "dsec.control.keys",
    "dsec.control.roles",
    "dsec.images.registry",
    "dsec.images.layer_registry",
    "dsec.control.iam",
    "dsec.control.iam_tables",
    "dsec.cluster.registry",
    "dsec.cluster.keys",
)
# Two apiservers starting at once against one PostgreSQL must not both migrate.
_PG_LOCK_KEY = 0x64736563  # "dsec"


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


def database_url(url: str) -> str:
    """The async SQLAlchemy URL for what a user typed (``postgres://...``, a file path)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        if not url:
            raise InvalidArgument("empty database URL")
        return sqlite_url(Path(url).absolute())  # a bare path: a SQLite file
    base = scheme.split("+", 1)[0].lower()
    if base in ("postgres", "postgresql"):
        return f"postgresql+asyncpg://{rest}"
    if base == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    raise InvalidArgument(
        f"unsupported database URL scheme {scheme!r}: use postgresql://... or sqlite:///path"
    )


def load_all_models() -> None:
    """Import every module that declares tables, so Base.metadata is complete."""
    for name in MODEL_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but something it imports does not
                raise


def alembic_config(url: str | None = None) -> Config:
    """An in-memory alembic config for our migrations (no alembic.ini anywhere)."""
    from alembic.config import Config  # alembic costs ~150 ms to import: only when used

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", database_url(url).replace("%", "%%"))
    return cfg


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def migrate(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrade the database to ``revision`` (idempotent; one transaction on PostgreSQL).

    A database from before migrations existed (tables, no alembic_version) is adopted
    at the baseline first: the baseline only creates the tables it lacks.
    """
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_downgrade, revision)


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at; None for an empty (or pre-migration) one."""
    from alembic.runtime.migration import MigrationContext

    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync: MigrationContext.configure(sync).get_current_revision()
        )


async def check_reachable(engine: AsyncEngine) -> None:
    """Open one connection, so "database down / wrong URL" is a typed error, not a trace."""
    from sqlalchemy.exc import DBAPIError

    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except (OSError, DBAPIError) as exc:
        where = engine.url.render_as_string(hide_password=True)
        cause = getattr(exc, "orig", None) or exc
        raise DatabaseUnavailable(
            f"cannot open the control database {where}: {cause}", url=where
        ) from None


def _locked_config(conn: Connection) -> Config:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    return cfg


def _upgrade(conn: Connection, revision: str) -> None:
    from alembic import command

    cfg = _locked_config(conn)
    tables = set(inspect(conn).get_table_names())
    if VERSION_TABLE not in tables and tables:
        log.info("adopting a pre-migration control database at %s", BASELINE)
        command.upgrade(cfg, BASELINE)
    command.upgrade(cfg, revision)


def _downgrade(conn: Connection, revision: str) -> None:
    from alembic import command

    command.downgrade(_locked_config(conn), revision)


async def create_all(engine: AsyncEngine) -> None:
    """Tables straight from the models, unversioned: only for throwaway test databases."""
    load_all_models()
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    return async_sessionmaker(engine, expire_on_commit=False)
