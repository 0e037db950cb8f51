"""`dsec events` and `dsec audit`: misbehaviour events and the audit log, by job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from dsec.api.events import AuditKind, EventKind
from dsec.cli.common import cells, emit_json, globals_of, inert, out, sync_client
from dsec.sdk.client import DSecClient

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
JobOpt = Annotated[str | None, typer.Option("--job", help="RL job id")]
SandboxOpt = Annotated[str | None, typer.Option("--sandbox", help="sandbox id")]
TrajectoryOpt = Annotated[str | None, typer.Option("--trajectory", help="trajectory id")]
SinceOpt = Annotated[int, typer.Option("--since", help="only rows after this seq")]
CursorOpt = Annotated[
    str | None,
    typer.Option(
        "--cursor",
        help="page on from a cursor ('' for the first page; the next one is printed): "
        "works across the edges of a cluster, where --since only works with --sandbox",
    ),
]
LimitOpt = Annotated[int, typer.Option("--limit", min=1, max=10_000)]
FollowOpt = Annotated[
    bool, typer.Option("--follow", "-f", help="keep printing records as they are written")
]


def _follow(
    ctx: typer.Context,
    kinds: list[str],
    job: str | None,
    sandbox: str | None,
    trajectory: str | None,
    since: int,
    as_json: bool,
) -> None:
    """Print records as they are written (GET /v1/events/stream) until Ctrl-C."""
    g = globals_of(ctx)

    async def run() -> None:
        async with DSecClient(g.url, g.api_key) as client:
            stream = client.follow_audit(
                job=job, sandbox=sandbox, trajectory=trajectory, kinds=kinds, since_seq=since
            )
            async for r in stream:
                if as_json:  # one JSON object per line: what a sandbox wrote stays escaped
                    sys.stdout.write(r.model_dump_json() + "\n")
                    sys.stdout.flush()
                    continue
                out.print(
                    *cells(r.seq, _when(r.time), r.sandbox_id, r.kind.value, r.action),
                    inert(_detail(r.detail)),
                )

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


def _detail(detail: dict[str, object]) -> str:
    """The detail as compact JSON (what a sandbox put in it stays quoted and escaped)."""
    text = json.dumps(detail, separators=(",", ":"), default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def _when(t: datetime) -> str:
    return t.strftime("%H:%M:%S.%f")[:-3]


def _filters(
    job: str | None, sandbox: str | None, trajectory: str | None, limit: int
) -> dict[str, Any]:
    return {"job": job, "sandbox": sandbox, "trajectory": trajectory, "limit": limit}


def _page_note(cursor: str, missing: list[str]) -> None:
    """The next cursor, and the edges whose rows this page lacks (they follow later)."""
    out.print(f"next: --cursor '{inert(cursor, 512)}'")
    if missing:
        shown = inert(", ".join(missing), 512)
        out.print(f"not in this page (edges down or silent): {shown}", style="yellow")


def events(
    ctx: typer.Context,
    job: JobOpt = None,
    sandbox: SandboxOpt = None,
    trajectory: TrajectoryOpt = None,
    kind: Annotated[list[EventKind], typer.Option("--kind", help="repeatable")] = [],  # noqa: B006
    since: SinceOpt = 0,
    cursor: CursorOpt = None,
    limit: LimitOpt = 1000,
    as_json: JsonOpt = False,
    follow: FollowOpt = False,
) -> None:
    """Misbehaviour events (protected paths, denied connections, seccomp, ...)."""
    if follow:
        if kind:
            raise typer.BadParameter("--follow shows every kind; filter by --sandbox or --job")
        _follow(ctx, [AuditKind.EVENT.value], job, sandbox, trajectory, since, as_json)
        return
    filters = _filters(job, sandbox, trajectory, limit)
    with sync_client(ctx) as client:
        if cursor is None:
            items, page = client.events(kinds=kind, since_seq=since, **filters), None
        else:
            page = client.events_page(kinds=kind, cursor=cursor, **filters)
            items = page.items
    if as_json:
        emit_json(items)
        return
    table = Table("seq", "time", "sandbox", "job", "kind", "severity", "detail", box=None)
    for e in items:
        table.add_row(
            *cells(
                e.seq,
                _when(e.time),
                e.sandbox_id,
                e.job_id or "-",
                e.kind.value,
                e.severity.value,
                _detail(e.detail),
            )
        )
    out.print(table)
    if page is not None:
        _page_note(page.cursor, page.missing)


def audit(
    ctx: typer.Context,
    job: JobOpt = None,
    sandbox: SandboxOpt = None,
    trajectory: TrajectoryOpt = None,
    kind: Annotated[list[AuditKind], typer.Option("--kind", help="repeatable")] = [],  # noqa: B006
    since: SinceOpt = 0,
    cursor: CursorOpt = None,
    limit: LimitOpt = 1000,
    as_json: JsonOpt = False,
    follow: FollowOpt = False,
) -> None:
    """The audit log: every command, file operation, network decision and event."""
    if follow:
        _follow(ctx, [k.value for k in kind], job, sandbox, trajectory, since, as_json)
        return
    filters = _filters(job, sandbox, trajectory, limit)
    with sync_client(ctx) as client:
        if cursor is None:
            items, page = client.audit(kinds=kind, since_seq=since, **filters), None
        else:
            page = client.audit_page(kinds=kind, cursor=cursor, **filters)
            items = page.items
    if as_json:
        emit_json(items)
        return
    table = Table("seq", "time", "sandbox", "kind", "action", "detail", box=None)
    for r in items:
        table.add_row(
            *cells(r.seq, _when(r.time), r.sandbox_id, r.kind.value, r.action, _detail(r.detail))
        )
    out.print(table)
    if page is not None:
        _page_note(page.cursor, page.missing)
