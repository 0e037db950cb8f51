"""`dsec db upgrade | current`: the control database's schema version.

Output is plain lines (no rich wrapping) so scripts can parse it; ``--json`` too.

Without ``--db`` these act on the single-node SQLite database of ``dsec up``
(``$DSEC_DATA_DIR/control.db``); in cluster mode pass the PostgreSQL URL every
apiserver uses. Apiservers and ``dsec up`` migrate on start anyway: this is for doing
it ahead of a rollout, and for seeing where a database stands.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Control database schema (migrations).", no_args_is_help=True)

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="DSEC_DB",
        help="database URL: postgresql://user@host/db or sqlite:///path "
        "(default: the dsec up control.db)",
    ),
]


def _url(db: str | None, *, create_dir: bool = False) -> str:
    from dsec.config import PlatformConfig
    from dsec.control.db import database_url, sqlite_url

    if db is not None:
        return database_url(db)
    path = PlatformConfig().control_db
    if create_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite_url(path)


def _shown(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


async def _revisions(url: str, *, upgrade: bool) -> tuple[str | None, str | None]:
    from dsec.control.db import check_reachable, current_revision, make_engine, migrate

    if url.startswith("sqlite"):
        parent = Path(url.split(":///", 1)[1]).parent
        if not parent.is_dir():
            from dsec.errors import InvalidArgument

            raise InvalidArgument(f"no directory {parent} for the SQLite database")
    engine = make_engine(url)
    try:
        await check_reachable(engine)
        before = await current_revision(engine)
        if upgrade:
            await migrate(engine)
        return before, await current_revision(engine)
    finally:
        await engine.dispose()


@app.command()
def upgrade(
    db: DbOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Bring the database schema to the newest revision (idempotent)."""
    url = _url(db, create_dir=True)
    before, after = asyncio.run(_revisions(url, upgrade=True))
    if as_json:
        typer.echo(json.dumps({"db": _shown(url), "from": before, "to": after}))
    elif before == after:
        typer.echo(f"{_shown(url)}: already at {after}")
    else:
        typer.echo(f"{_shown(url)}: {before or 'empty'} -> {after}")


@app.command()
def current(
    db: DbOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Show the database's schema revision and the newest one this version knows."""
    from dsec.control.db import head_revision

    url = _url(db)
    _, rev = asyncio.run(_revisions(url, upgrade=False))
    head = head_revision()
    if as_json:
        typer.echo(json.dumps({"db": _shown(url), "current": rev, "head": head}))
        return
    state = "up to date" if rev == head else f"behind head {head}: run `dsec db upgrade`"
    typer.echo(f"{_shown(url)}: {rev or 'none'} ({state})")
