"""Alembic environment of the control database, driven from code: no alembic.ini.

``dsec.control.db.migrate(engine)`` (and ``dsec db upgrade``) hands alembic an open
connection through ``config.attributes["connection"]``; every revision then runs in
that connection's transaction (one transaction on PostgreSQL, serialised across
apiservers by an advisory lock taken in ``migrate``). Without a connection (alembic's
own commands, e.g. autogenerating a draft) the URL in ``sqlalchemy.url`` is used.

How to add a revision
---------------------
1. Change or add the model (a class on ``dsec.control.db.Base``); if it lives in a new
   module, add that module to ``dsec.control.db.MODEL_MODULES``.
2. Create ``versions/NNNN_name.py`` with ``revision = "NNNN_name"`` and
   ``down_revision`` = the current head (``dsec db current`` shows it; revisions form
   one straight line: ``0001_baseline`` <- ``0002_iam`` <- ``0003_cluster`` <- ...).
   A draft can be generated against a database at the previous head::

       from alembic import command
       from dsec.control.db import alembic_config
       command.revision(alembic_config("sqlite+aiosqlite:////tmp/x.db"), "name",
                        autogenerate=True, rev_id="NNNN_name")

   but the committed file must be explicit ``op.create_table`` / ``op.add_column`` ...
   code, never ``Base.metadata`` (a model changes later; a revision never does).
3. Write ``downgrade()`` too, and wrap column changes on existing tables in
   ``with op.batch_alter_table(...)`` so they also work on SQLite.
4. ``pytest tests/test_db.py``: it migrates fresh SQLite and PostgreSQL databases to
   head and fails if the result differs from the models in any way.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection, pool
from sqlalchemy.ext.asyncio import create_async_engine

from dsec.control.db import Base, load_all_models

load_all_models()
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_url(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


def main() -> None:
    if context.is_offline_mode():
        context.configure(
            url=context.config.get_main_option("sqlalchemy.url"),
            target_metadata=target_metadata,
            literal_binds=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection and no sqlalchemy.url to migrate")
    asyncio.run(_run_with_url(url))


main()
