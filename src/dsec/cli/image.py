"""`dsec image ...`: pull, import, import-vm, build, ls, rm."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from dsec.api.images import ImageInfo
from dsec.cli.common import cells, emit, emit_json, err, human_bytes, out, sync_client

app = typer.Typer(help="Import, build, list and remove images.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


class Format(StrEnum):
    auto = "auto"
    tar = "tar"
    oci = "oci"


class Recipe(StrEnum):
    busybox = "busybox"
    debian_python = "debian-python"
    debian_desktop = "debian-desktop"  # a VM image (fullvm), built where the CLI runs


def _describe(info: ImageInfo) -> str:
    return (
        f"{info.ref}  {info.digest[:19]}  {len(info.layers)} layer(s)  "
        f"{human_bytes(info.size_bytes)}"
    )


@app.command("pull")
def pull(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="[registry[:port]/]path[:tag][@sha256:<hex>] to pull")],
    username: Annotated[
        str | None, typer.Option("--username", "-u", help="registry user (for this pull)")
    ] = None,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="read the registry password from stdin")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Pull an image from an OCI registry onto the platform (no Docker daemon).

    Plain-HTTP registries must be named when the platform starts
    (`dsec up --insecure-registry HOST:PORT`); credentials come from --username and
    --password-stdin, else the platform's credentials file (Docker config.json)."""
    password = typer.get_text_stream("stdin").read().rstrip("\n") if password_stdin else None
    if (username is None) != (password is None):
        raise typer.BadParameter("--username and --password-stdin go together")
    with sync_client(ctx) as client, err.status(f"pulling {ref}"):
        result = client.pull_image(ref, username=username, password=password)
    reused = sum(layer.reused for layer in result.layers)
    emit(
        result,
        f"pulled {_describe(result.image)}: {len(result.layers)} registry layer(s), "
        f"{reused} reused, {human_bytes(result.bytes_fetched)} fetched in {result.seconds:.1f}s",
        as_json,
    )


@app.command("import")
def import_(
    ctx: typer.Context,
    path: Annotated[
        Path, typer.Argument(help="rootfs tar, `docker save` tar, OCI layout tar, or a directory")
    ],
    ref: Annotated[str, typer.Argument(help="name:tag to store it under")],
    fmt: Annotated[Format, typer.Option("--format", "-f", help="archive format")] = Format.auto,
    as_json: JsonOpt = False,
) -> None:
    """Upload an archive or a directory (tarred on the fly) as an image."""
    with (
        sync_client(ctx) as client,
        Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as progress,
    ):
        task = progress.add_task(f"uploading {path.name}", total=None)

        def on_progress(sent: int, total: int | None) -> None:
            progress.update(task, completed=sent, total=total)
            if total is not None and sent >= total:
                progress.update(task, description=f"importing {ref} on the platform")

        info = client.import_image(ref, path, fmt.value, progress=on_progress)
    emit(info, f"imported {_describe(info)}", as_json)


@app.command("import-vm")
def import_vm(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="name:tag to store it under")],
    disk: Annotated[Path, typer.Argument(help="the VM's disk: raw or qcow2 (no backing file)")],
    kernel: Annotated[
        Path | None, typer.Option("--kernel", help="boot this kernel directly (no boot loader)")
    ] = None,
    initrd: Annotated[Path | None, typer.Option("--initrd", help="its initrd")] = None,
    cmdline: Annotated[
        str | None, typer.Option("--append", help="its command line (with --kernel)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload a VM image for the fullvm backend (each file stored content-addressed)."""
    with sync_client(ctx) as client, err.status(f"uploading {disk.name} ..."):
        info = client.import_vm(ref, disk, kernel=kernel, initrd=initrd, cmdline=cmdline)
    emit(info, f"imported {_describe(info)}", as_json)


@app.command()
def build(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            help="a built-in recipe (busybox, debian-python, debian-desktop), or with -f "
            "the build context directory"
        ),
    ],
    ref: Annotated[
        str | None, typer.Argument(help="with -f: name:tag of the image to build")
    ] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="build this Dockerfile")] = None,
    build_arg: Annotated[
        list[str] | None, typer.Option("--build-arg", help="KEY=VALUE for an ARG (repeatable)")
    ] = None,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow", help="egress the RUN steps may use: a service name or IPv4 rule (repeatable)"
        ),
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="with -f: run every step again")
    ] = False,
    stage: Annotated[
        str | None,
        typer.Option("--target", help="with -f: build this stage (default: the last)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="store as this name:tag instead")
    ] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="ignore the cached image")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build busybox:latest, debian-python:bookworm or the debian-desktop:bookworm VM
    image (minutes the first time; debian-desktop is built on this host, as root, and
    imported like `dsec image import-vm`), or with `-f Dockerfile CONTEXT NAME:TAG` an
    image from a Dockerfile: every RUN in a sandbox of this platform (egress only to
    --allow services), every step a cached layer."""
    if file is not None:
        if ref is None:
            raise typer.BadParameter("usage: dsec image build -f Dockerfile CONTEXT NAME:TAG")
        _build_dockerfile(
            ctx, file, Path(target), ref, build_arg or [], allow or [], no_cache, stage, as_json
        )
        return
    if ref is not None:
        raise typer.BadParameter("a recipe takes no NAME:TAG argument (use --name), or give -f")
    try:
        recipe = Recipe(target)
    except ValueError:
        raise typer.BadParameter(
            f"unknown recipe {target!r}: busybox, debian-python, debian-desktop "
            "(or -f Dockerfile CONTEXT NAME:TAG)"
        ) from None
    if recipe is Recipe.debian_desktop:
        _build_desktop(ctx, name or "debian-desktop:bookworm", rebuild, as_json)
        return
    with (
        sync_client(ctx) as client,
        err.status(f"building {recipe.value} (cached images return at once)..."),
    ):
        info = client.build_image(recipe.value, name=name, rebuild=rebuild)
    emit(info, f"built {_describe(info)}", as_json)


def _build_dockerfile(
    ctx: typer.Context,
    dockerfile: Path,
    context: Path,
    ref: str,
    build_args: list[str],
    allow: list[str],
    no_cache: bool,
    stage: str | None,
    as_json: bool,
) -> None:
    import asyncio

    from dsec.cli.common import globals_of
    from dsec.sdk.client import DSecClient
    from dsec.sdk.dockerfile import StepReport, build_dockerfile

    args: dict[str, str] = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--build-arg {item!r}: expected KEY=VALUE")
        args[key] = value
    g = globals_of(ctx)

    def on_step(step: StepReport) -> None:
        what = "cached" if step.cached else f"{step.seconds:.1f}s"
        err.print(f"  line {step.line}: {step.instruction} ({what})", markup=False)

    async def run() -> ImageInfo:
        async with DSecClient(g.url, g.api_key, timeout=None) as client:
            result = await build_dockerfile(
                client,
                dockerfile,
                context,
                ref,
                build_args=args,
                network_rules={name: True for name in allow},
                no_cache=no_cache,
                target=stage,
                on_step=on_step,
            )
            return result.image

    info = asyncio.run(run())
    emit(info, f"built {_describe(info)}", as_json)


def _build_desktop(ctx: typer.Context, ref: str, rebuild: bool, as_json: bool) -> None:
    import asyncio

    from dsec.guest.desktopimage import build_desktop_image

    with err.status("building debian-desktop (debootstrap, cached afterwards) ...") as status:

        def progress(message: str, _done: int, _total: int | None) -> None:
            status.update(message[:120])

        files = asyncio.run(build_desktop_image(rebuild=rebuild, progress=progress))
    with sync_client(ctx) as client, err.status(f"importing {ref} ..."):
        info = client.import_vm(
            ref, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
        )
    emit(info, f"built {_describe(info)}", as_json)


@app.command("ls")
def list_(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List images."""
    with sync_client(ctx) as client:
        images = sorted(client.list_images(), key=lambda i: i.ref)
    if as_json:
        emit_json(images)
        return
    if not images:
        err.print("no images (try `dsec image build busybox`)")
        return
    table = Table(box=None, header_style="bold")
    for col in ("REF", "DIGEST", "LAYERS", "SIZE", "CREATED"):
        table.add_column(col)
    for info in images:
        table.add_row(
            *cells(
                info.ref,
                info.digest[:19],
                str(len(info.layers)),
                human_bytes(info.size_bytes),
                info.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
                limit=512,
            )
        )
    out.print(table)


@app.command("rm")
def remove(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="name:tag")],
    as_json: JsonOpt = False,
) -> None:
    """Remove an image tag (layers go once no image uses them)."""
    with sync_client(ctx) as client:
        info = client.remove_image(ref)
    emit(info, f"removed {info.ref}", as_json)
