"""Schema migrations on real SQLite and PostgreSQL databases.

The comparison test is the guard rail for everybody who adds a table: a model and its
revision that disagree in any column, type, index or nullability fail here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from dsec.cli.main import run
from dsec.control.db import (
    BASELINE,
    MODEL_MODULES,
    Base,
    alembic_config,
    current_revision,
    database_url,
    downgrade,
    head_revision,
    load_all_models,
    make_engine,
    migrate,
    sqlite_url,
)
from dsec.control.keys import KeyStore
from dsec.errors import InvalidArgument, Unauthenticated
from tests.pg import PostgresServer

BASELINE_TABLES = (
    "api_keys",
    "principal_roles",
    "images",
    "image_layers",
    "layer_tags",
    "layer_indexes",
)


@pytest.fixture(params=["sqlite", "postgresql"])
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    """A fresh empty database of each kind."""
    if request.param == "sqlite":
        url = sqlite_url(tmp_path / "control.db")
    else:
        url = request.getfixturevalue("pg_url")
    eng = make_engine(url)
    try:
        yield eng
    finally:
        await eng.dispose()


def _describe(op: Any) -> str:
    """One difference as 'kind table.thing' (alembic's own tuples print whole tables)."""
    if isinstance(op, list):  # modify_* of one column come grouped
        return "; ".join(_describe(o) for o in op)
    kind, rest = op[0], op[1:]
    if kind in ("add_table", "remove_table"):
        return f"{kind} {rest[0].name}"
    if kind in ("add_index", "remove_index", "add_constraint", "remove_constraint"):
        return f"{kind} {rest[0].table.name}.{rest[0].name}"
    if kind in ("add_column", "remove_column"):
        return f"{kind} {rest[1]}.{rest[2].name}"
    if kind.startswith("modify_"):
        return f"{kind} {rest[1]}.{rest[2]}: db {rest[-2]!r} vs model {rest[-1]!r}"
    return repr(op)


def _schema_diff(conn: Connection) -> list[str]:
    """How the database differs from the models, as the next revision would have to fix."""
    load_all_models()
    ctx = MigrationContext.configure(conn, opts={"compare_type": True})
    return [_describe(op) for op in compare_metadata(ctx, Base.metadata)]


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


async def schema_diff(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        return await conn.run_sync(_schema_diff)


async def assert_matches_models(engine: AsyncEngine) -> None:
    diff = await schema_diff(engine)
    assert not diff, (
        f"{engine.dialect.name} schema at head differs from the models (a revision is "
        "missing or disagrees with its model):\n  " + "\n  ".join(diff)
    )


async def tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return await conn.run_sync(_tables)


def test_revisions_form_one_line_from_the_baseline() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    heads = script.get_heads()
    assert len(heads) == 1, f"several heads {heads}: a new revision must revise the last one"
    chain = [s.revision for s in script.walk_revisions("base", "heads")]
    assert chain[-1] == BASELINE
    assert head_revision() == chain[0]


def test_every_module_with_tables_is_loaded_for_migrations() -> None:
    # Otherwise env.py and the comparison below would not see that module's tables.
    src = Path(__file__).resolve().parent.parent / "src"
    declaring = {
        ".".join(path.relative_to(src).with_suffix("").parts)
        for path in (src / "dsec").rglob("*.py")
        if "__tablename__" in path.read_text()
    }
    assert declaring <= set(MODEL_MODULES), "add them to dsec.control.db.MODEL_MODULES"


async def test_migrate_reaches_head_and_matches_the_models(engine: AsyncEngine) -> None:
    started = time.perf_counter()
    await migrate(engine)
    elapsed = time.perf_counter() - started
    print(f"migrate() on a fresh {engine.dialect.name} db: {elapsed * 1000:.0f} ms")
    assert await current_revision(engine) == head_revision()
    await assert_matches_models(engine)
    assert set(BASELINE_TABLES) <= await tables(engine)


async def test_migrate_is_idempotent(engine: AsyncEngine) -> None:
    await migrate(engine)
    keys = KeyStore(engine)
    await keys.ensure("dsk_idem", principal="alice")
    started = time.perf_counter()
    await migrate(engine)
    elapsed = time.perf_counter() - started
    print(f"migrate() at head on {engine.dialect.name}: {elapsed * 1000:.1f} ms")
    assert await current_revision(engine) == head_revision()
    assert await KeyStore(engine).verify("dsk_idem") == "alice"
    await assert_matches_models(engine)


@pytest.mark.parametrize("made_by", ["all baseline tables", "old create_all"])
async def test_pre_migration_sqlite_db_is_adopted_without_data_loss(
    tmp_path: Path, made_by: str
) -> None:
    # What `dsec up` left before migrations: create_all of the models of the day, no
    # alembic_version. Older data dirs lack the tables later components created.
    load_all_models()
    names = (
        BASELINE_TABLES
        if made_by == "all baseline tables"
        else ("api_keys", "images", "image_layers")
    )
    eng = make_engine(sqlite_url(tmp_path / "control.db"))
    try:
        async with eng.begin() as conn:
            await conn.run_sync(
                lambda sync: Base.metadata.create_all(
                    sync, tables=[Base.metadata.tables[n] for n in names]
                )
            )
        await KeyStore(eng).ensure("dsk_legacy_key", principal="bob")
        assert await current_revision(eng) is None

        await migrate(eng)

        assert await current_revision(eng) == head_revision()
        assert await KeyStore(eng).verify("dsk_legacy_key") == "bob"
        await assert_matches_models(eng)
    finally:
        await eng.dispose()


async def test_downgrade_to_base_and_upgrade_again_on_postgresql(pg_url: str) -> None:
    eng = make_engine(pg_url)
    try:
        await migrate(eng)
        await downgrade(eng, "base")
        assert await current_revision(eng) is None
        assert await tables(eng) <= {"alembic_version"}
        await migrate(eng)
        assert await current_revision(eng) == head_revision()
        await assert_matches_models(eng)
    finally:
        await eng.dispose()


async def test_concurrent_migrations_on_postgresql_serialise(pg_url: str) -> None:
    # Several apiservers starting at once against one fresh database.
    engines = [make_engine(pg_url) for _ in range(3)]
    try:
        await asyncio.gather(*(migrate(e) for e in engines))
        assert await current_revision(engines[0]) == head_revision()
        await assert_matches_models(engines[0])
    finally:
        for e in engines:
            await e.dispose()


async def test_keystore_end_to_end_on_postgresql(pg_url: str) -> None:
    eng = make_engine(pg_url)
    try:
        await migrate(eng)
        keys = KeyStore(eng)
        await keys.ensure("dsk_bootstrap", principal="admin")
        await keys.ensure("dsk_bootstrap", principal="admin")  # idempotent
        created = await keys.create("carol")
        # A second store (another apiserver) sees the database, not the first's cache.
        other = KeyStore(eng)
        assert await other.verify("dsk_bootstrap") == "admin"
        assert await other.verify(created) == "carol"
        assert [p for p, _ in await other.principals()] == ["admin", "carol"]
        assert await keys.revoke(created) is True
        assert await keys.revoke(created) is False
        with pytest.raises(Unauthenticated):
            await keys.verify(created)
        with pytest.raises(Unauthenticated):
            await KeyStore(eng).verify(created)
    finally:
        await eng.dispose()


def test_database_url_normalisation(tmp_path: Path) -> None:
    assert database_url("postgres://u:p@h:5/db") == "postgresql+asyncpg://u:p@h:5/db"
    assert database_url("postgresql://h/db") == "postgresql+asyncpg://h/db"
    assert database_url("postgresql+psycopg2://h/db") == "postgresql+asyncpg://h/db"
    assert database_url("sqlite:////x/c.db") == "sqlite+aiosqlite:////x/c.db"
    assert database_url(str(tmp_path / "c.db")) == sqlite_url(tmp_path / "c.db")
    with pytest.raises(InvalidArgument):
        database_url("mysql://h/db")
    with pytest.raises(InvalidArgument):
        database_url("")


def test_cli_db_upgrade_and_current(
    postgres: PostgresServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = pg_url.replace("postgresql+asyncpg://", "postgres://")
    assert run(["db", "current", "--db", plain, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["current"] is None
    assert run(["db", "upgrade", "--db", plain]) == 0
    assert f"-> {head_revision()}" in capsys.readouterr().out
    assert run(["db", "upgrade", "--db", plain]) == 0
    assert "already at" in capsys.readouterr().out
    assert run(["db", "current", "--db", plain, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["current"] == doc["head"] == head_revision()
    assert "postgres" in doc["db"]


def test_cli_db_typed_errors(
    postgres: PostgresServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = postgres.url_for("no_such_db").replace("postgresql+asyncpg", "postgresql")
    assert run(["db", "current", "--db", missing]) == 1
    assert "database_unavailable" in capsys.readouterr().err
    assert run(["db", "upgrade", "--db", "mysql://h/db"]) == 1
    assert "invalid_argument" in capsys.readouterr().err
    assert run(["db", "upgrade", "--db", f"sqlite:///{tmp_path}/nodir/c.db"]) == 1
    assert "invalid_argument" in capsys.readouterr().err


def test_cli_db_upgrade_defaults_to_the_single_node_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsec.config import PlatformConfig

    monkeypatch.setattr(
        PlatformConfig, "control_db", property(lambda _: tmp_path / "data/control.db")
    )
    assert run(["db", "upgrade"]) == 0
    assert (tmp_path / "data" / "control.db").is_file()
    assert run(["db", "current", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["current"] == head_revision()


def test_postgres_server_starts_quickly(postgres: PostgresServer) -> None:
    print(f"PostgreSQL test server startup: {postgres.startup_seconds:.2f} s")
    assert postgres.alive()
    assert postgres.psql("SHOW fsync") == "off"
