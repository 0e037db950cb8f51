"""`dsec job pause|resume`, `dsec env pack|fork`, `dsec role grant|revoke`: RL co-design."""

from __future__ import annotations

from typing import Annotated

import typer

from dsec.cli.common import emit, emit_json, out, sync_client

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
MiB = 1024 * 1024

job_app = typer.Typer(help="Pause and resume every sandbox of an RL job.", no_args_is_help=True)
env_app = typer.Typer(help="Pack a sandbox's changes into a layer; fork it.", no_args_is_help=True)
role_app = typer.Typer(help="Grant or revoke roles (admin only).", no_args_is_help=True)


@job_app.command("pause")
def pause(ctx: typer.Context, job_id: str, as_json: JsonOpt = False) -> None:
    """Freeze the job's running sandboxes and reclaim their memory (state is kept)."""
    with sync_client(ctx, timeout=None) as client:
        rep = client.pause_job(job_id)
    note = "" if rep.swap_available else " (no swap: anonymous memory stays resident)"
    emit(
        rep,
        f"paused {rep.paused} sandboxes of {job_id} in {rep.duration * 1000:.1f} ms, "
        f"reclaimed {rep.memory_reclaimed_bytes / MiB:.1f} MiB{note}",
        as_json,
    )


@job_app.command("resume")
def resume(ctx: typer.Context, job_id: str, as_json: JsonOpt = False) -> None:
    """Thaw the job's paused sandboxes (any request to one thaws it too)."""
    with sync_client(ctx) as client:
        rep = client.resume_job(job_id)
    emit(
        rep, f"resumed {rep.resumed} sandboxes of {job_id} in {rep.duration * 1000:.1f} ms", as_json
    )


@env_app.command("pack")
def pack(
    ctx: typer.Context,
    sandbox_id: str,
    ref: Annotated[str, typer.Argument(help="layer name[:version]")],
    as_json: JsonOpt = False,
) -> None:
    """The sandbox's changes as a new layer (needs the builder role)."""
    name, _, version = ref.partition(":")
    with sync_client(ctx, timeout=None) as client:
        env = client.get(sandbox_id).pack_diff(name, version or "latest")
    slot = "--toolkit" if env.toolkit is not None else "--workspace"
    emit(
        env,
        f"packed {sandbox_id} into {env.layer.name}:{env.layer.version} "
        f"({env.layer.size_bytes / MiB:.1f} MiB, {env.files} entries); start from it with "
        f"{slot} {env.layer.name}:{env.layer.version}",
        as_json,
    )


@env_app.command("fork")
def fork(ctx: typer.Context, sandbox_id: str, n: int, as_json: JsonOpt = False) -> None:
    """pack + N sandboxes from the packed layer (needs the builder role)."""
    with sync_client(ctx, timeout=None) as client:
        children = client.get(sandbox_id).fork(n)
    if as_json:
        emit_json([c.info for c in children])
        return
    for child in children:
        out.print(child.id)


@role_app.command("grant")
def grant(ctx: typer.Context, principal: str, role: str) -> None:
    with sync_client(ctx) as client:
        client.grant_role(principal, role)
    out.print(f"granted {role} to {principal}")


@role_app.command("revoke")
def revoke(ctx: typer.Context, principal: str, role: str) -> None:
    with sync_client(ctx) as client:
        client.revoke_role(principal, role)
    out.print(f"revoked {role} from {principal}")
