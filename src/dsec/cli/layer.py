"""`dsec layer ...`: build, push, pull, ls, tag, rm of composable layers."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dsec.api.layers import LayerInfo
from dsec.cli.common import cells, emit, emit_json, err, human_bytes, out, sync_client

app = typer.Typer(help="Build, push, pull, list, tag and remove layers.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


class Kind(StrEnum):
    base = "base"
    workspace = "workspace"
    toolkit = "toolkit"


def _describe(info: LayerInfo) -> str:
    return f"{info.ref}  {info.digest[:19]}  {info.kind}  {human_bytes(info.size_bytes)}"


def _show(info: LayerInfo, verb: str, as_json: bool) -> None:
    emit(info, f"{verb} {_describe(info)}", as_json)


@app.command()
def build(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="name:version to register it under")],
    directory: Annotated[
        Path | None, typer.Option("--dir", help="a directory on the platform host")
    ] = None,
    tar: Annotated[
        Path | None, typer.Option("--tar", help="a tar file on the platform host")
    ] = None,
    git: Annotated[
        Path | None, typer.Option("--git", help="a git checkout on the platform host")
    ] = None,
    rev: Annotated[str | None, typer.Option("--rev", help="git revision (default HEAD)")] = None,
    prefix: Annotated[
        str, typer.Option("--prefix", help="where the content lands in the sandbox")
    ] = "/",
    kind: Annotated[Kind, typer.Option("--kind")] = Kind.workspace,
    as_json: JsonOpt = False,
) -> None:
    """Build a layer from a directory, a tar or a git checkout (exactly one)."""
    given = [(k, v) for k, v in (("dir", directory), ("tar", tar), ("git", git)) if v is not None]
    if len(given) != 1:
        raise typer.BadParameter("give exactly one of --dir, --tar, --git")
    source, path = given[0]
    with sync_client(ctx, timeout=None) as client, err.status(f"building {ref}..."):
        info = client.build_layer(
            ref, source, str(path.resolve()), rev=rev, prefix=prefix, kind=kind.value
        )
    _show(info, "built", as_json)


@app.command()
def push(
    ctx: typer.Context, ref: Annotated[str, typer.Argument()], as_json: JsonOpt = False
) -> None:
    """Upload a layer (blob, chunk index, reference) to the shared layer store."""
    with sync_client(ctx, timeout=None) as client, err.status(f"pushing {ref}..."):
        info = client.push_layer(ref)
    _show(info, "pushed", as_json)


@app.command()
def pull(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument()],
    lazy: Annotated[
        bool, typer.Option("--lazy", help="only the reference: chunks load on first read")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Fetch a layer from the shared layer store onto this platform."""
    with sync_client(ctx, timeout=None) as client, err.status(f"pulling {ref}..."):
        info = client.pull_layer(ref, blob=not lazy)
    _show(info, "pulled", as_json)


@app.command("ls")
def list_(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List layers."""
    with sync_client(ctx) as client:
        layers = client.list_layers()
    if as_json:
        emit_json(layers)
        return
    if not layers:
        err.print("no layers (try `dsec layer build NAME:VERSION --dir PATH`)")
        return
    table = Table(box=None, header_style="bold")
    for col in ("REF", "DIGEST", "KIND", "SIZE", "CREATED"):
        table.add_column(col)
    for info in layers:
        table.add_row(
            *cells(
                info.ref,
                info.digest[:19],
                info.kind,
                human_bytes(info.size_bytes),
                info.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
                limit=512,
            )
        )
    out.print(table)


@app.command()
def tag(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="layer name:version, image name:tag or digest")],
    target: Annotated[str, typer.Argument(help="new name:version")],
    as_json: JsonOpt = False,
) -> None:
    """Give a layer (or a single-layer image) another name:version."""
    with sync_client(ctx) as client:
        info = client.tag_layer(source, target)
    _show(info, "tagged", as_json)


@app.command("rm")
def remove(
    ctx: typer.Context, ref: Annotated[str, typer.Argument()], as_json: JsonOpt = False
) -> None:
    """Remove a layer tag (the blob goes once nothing references or mounts it)."""
    with sync_client(ctx) as client:
        info = client.remove_layer(ref)
    _show(info, "removed", as_json)
