"""`dsec trajectory show|export|discard`: what an agent did, step by step."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli.common import cells, emit_json, out, sync_client

app = typer.Typer(help="The trajectory log of RL rollouts (logged, replayable steps).")

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _short(value: object, width: int = 60) -> str:
    """A request or result cut to ``width`` (``cells`` then makes it inert)."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


@app.command("show")
def show(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id")],
    rollout: Annotated[str | None, typer.Argument(help="rollout id; omit to list them")] = None,
    after: Annotated[int, typer.Option("--after", help="only steps after this one")] = -1,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """A job's rollouts, or one rollout's logged steps in order."""
    with sync_client(ctx) as client:
        if rollout is None:
            infos = client.trajectories(job)
            if as_json:
                emit_json(infos)
                return
            table = Table("rollout", "steps", "discarded", "sandboxes", "updated", box=None)
            for i in infos:
                table.add_row(
                    *cells(
                        i.rollout_id,
                        i.steps,
                        i.discarded,
                        ",".join(i.sandboxes),
                        i.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
                        limit=512,
                    )
                )
            out.print(table)
            return
        recs = client.trajectory_steps(job, rollout, after=after, limit=limit)
    if as_json:
        emit_json(recs)
        return
    table = Table("step", "op", "sandbox", "request", "status", "result", "replays", box=None)
    for r in recs:
        req = r.request.get("command") or r.request.get("file") or {}
        what = req.get("command", req.get("path", "")) if isinstance(req, dict) else req
        res: object = r.result if r.result is not None else r.error
        if r.result is not None and "exit_code" in r.result:
            res = f"exit {r.result['exit_code']}: {r.result.get('stdout', '')}"
        table.add_row(
            *cells(r.step, r.op, r.sandbox_id, _short(what), r.status, _short(res or ""), r.replays)
        )
    out.print(table)


@app.command("export")
def export(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id")],
    rollout: Annotated[str | None, typer.Argument(help="only this rollout")] = None,
) -> None:
    """Every logged step as JSONL on stdout (one JSON object a line, in order)."""
    with sync_client(ctx, timeout=None) as client:
        sys.stdout.write(client.export_trajectories(job, rollout))
    sys.stdout.flush()


@app.command("discard")
def discard(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id")],
    rollout: Annotated[str, typer.Argument(help="rollout id")],
    from_step: Annotated[int, typer.Option("--from-step", min=0)],
) -> None:
    """Drop a step and everything after it (e.g. one in doubt after a platform crash)."""
    with sync_client(ctx) as client:
        n = client.discard_trajectory_steps(job, rollout, from_step)
    out.print(f"discarded {n} step(s)")
