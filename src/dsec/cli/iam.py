"""`dsec project|principal|key|quota`: IAM from the shell (dsec.control.iam).

Project paths are trees (`rl/math`); roles (`admin` > `builder` > `runtime`) are
granted on a project and hold on its subtree; `*` is the root (every project).
"""

from __future__ import annotations

from typing import Annotated

import typer

from dsec.api.iam import ROOT, PrincipalInfo, QuotaInfo
from dsec.cli.common import emit, emit_json, emit_rows, out, sync_client

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]

project_app = typer.Typer(help="Nested projects and their roles.", no_args_is_help=True)
principal_app = typer.Typer(help="Principals (humans and agents).", no_args_is_help=True)
key_app = typer.Typer(help="API keys of principals.", no_args_is_help=True)
quota_app = typer.Typer(help="Project quotas and usage.", no_args_is_help=True)


def _limit(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:g}{unit}"


def _quota_text(q: QuotaInfo) -> str:
    lines = [
        f"{q.project}: sandboxes {q.usage.sandboxes}/{_limit(q.limits.max_sandboxes)}, "
        f"cpu {q.usage.cpu_cores:g}/{_limit(q.limits.cpu_cores)} cores, "
        f"memory {q.usage.memory_mb}/{_limit(q.limits.memory_mb)} MiB  (used/limit; - = "
        "bounded by the parent only)"
    ]
    lines.extend(f"warning: {w}" for w in q.warnings)
    return "\n".join(lines)


def _principal_line(p: PrincipalInfo) -> str:
    default = f" default={p.default_project}" if p.default_project else ""
    return f"{p.name} ({p.kind}, by {p.created_by or '-'}){default}"


@project_app.command("create")
def project_create(ctx: typer.Context, path: str, as_json: JsonOpt = False) -> None:
    """Create a project (a sub-project needs admin on its parent)."""
    with sync_client(ctx) as client:
        info = client.create_project(path)
    emit(info, f"created project {info.path}", as_json)


@project_app.command("list")
def project_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The projects you hold some role on."""
    with sync_client(ctx) as client:
        items = client.projects()
    emit_rows(items, lambda p: p.path, as_json)


@project_app.command("show")
def project_show(ctx: typer.Context, path: str, as_json: JsonOpt = False) -> None:
    """A project's quota, usage and role bindings."""
    with sync_client(ctx) as client:
        info = client.project(path)
        quota = client.quota(path)
        roles = client.roles(path)
    if as_json:
        emit_json([info, quota, *roles])
        return
    out.print(f"{info.path} (parent {info.parent or ROOT}, created {info.created_at:%Y-%m-%d})")
    out.print(_quota_text(quota), markup=False)
    for b in roles:
        via = f" (from {b.inherited_from})" if b.inherited_from else ""
        out.print(f"  {b.principal}: {b.role.value}{via}", markup=False)


@project_app.command("delete")
def project_delete(ctx: typer.Context, path: str) -> None:
    """Delete an empty project."""
    with sync_client(ctx) as client:
        client.delete_project(path)
    out.print(f"deleted project {path}")


@project_app.command("grant")
def project_grant(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(help="project path, or '*' for every project")],
    principal: str,
    role: Annotated[str, typer.Argument(help="admin, builder or runtime")],
) -> None:
    """Grant a role on a project and its subtree (never above your own)."""
    with sync_client(ctx) as client:
        b = client.grant(principal, role, project=path)
    out.print(f"granted {b.role.value} on {b.project} to {b.principal}", markup=False)


@project_app.command("revoke")
def project_revoke(ctx: typer.Context, path: str, principal: str) -> None:
    """Remove a principal's binding on exactly this project."""
    with sync_client(ctx) as client:
        client.revoke(principal, project=path)
    out.print(f"revoked {principal}'s role on {path}", markup=False)


@principal_app.command("create")
def principal_create(
    ctx: typer.Context,
    name: str,
    kind: Annotated[str, typer.Option(help="human or agent")] = "agent",
    default_project: Annotated[
        str | None, typer.Option(help="charged when a create names no project")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a principal; it holds no role until granted one (`dsec project grant`)."""
    with sync_client(ctx) as client:
        p = client.create_principal(name, kind=kind, default_project=default_project)
    emit(p, f"created {p.kind} {p.name}", as_json)


@principal_app.command("list")
def principal_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    with sync_client(ctx) as client:
        items = client.principals()
    emit_rows(items, _principal_line, as_json)


@key_app.command("create")
def key_create(ctx: typer.Context, principal: str, as_json: JsonOpt = False) -> None:
    """A new API key; printed once, only its hash is stored."""
    with sync_client(ctx) as client:
        k = client.create_key(principal)
    emit(k, k.key, as_json)


@key_app.command("list")
def key_list(
    ctx: typer.Context,
    principal: Annotated[str | None, typer.Option(help="only this principal's")] = None,
    as_json: JsonOpt = False,
) -> None:
    with sync_client(ctx) as client:
        items = client.keys(principal)
    emit_rows(items, lambda k: f"{k.id}  {k.principal}  {k.created_at:%Y-%m-%d %H:%M}", as_json)


@key_app.command("revoke")
def key_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key by the id `dsec key list` shows."""
    with sync_client(ctx) as client:
        k = client.revoke_key(key_id)
    out.print(f"revoked key {k.id} of {k.principal}", markup=False)


@quota_app.command("show")
def quota_show(ctx: typer.Context, path: str, as_json: JsonOpt = False) -> None:
    with sync_client(ctx) as client:
        q = client.quota(path)
    emit(q, _quota_text(q), as_json)


@quota_app.command("set")
def quota_set(
    ctx: typer.Context,
    path: str,
    sandboxes: Annotated[int | None, typer.Option(help="max sandboxes")] = None,
    cpu: Annotated[float | None, typer.Option(help="CPU cores")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="memory in MiB")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Replace a project's limits (an omitted one: no limit at this level); needs admin
    on the parent, never above the parent's limit."""
    with sync_client(ctx) as client:
        q = client.set_quota(path, max_sandboxes=sandboxes, cpu_cores=cpu, memory_mb=memory_mb)
    emit(q, _quota_text(q), as_json)
