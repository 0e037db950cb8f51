"""`dsec up`: run the whole single-node platform in this process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.panel import Panel
from rich.text import Text

from dsec.cli.common import ANY_PORT_HELP, globals_of, inert, out, serving
from dsec.config import (
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_PORT,
    PlatformConfig,
    parse_mirrors,
    save_client_config,
)
from dsec.edge.identity import check_edge_id
from dsec.errors import DSecError


def announce(url: str, api_key: str, saved_to: Path | None) -> None:
    url, api_key = inert(url), inert(api_key)
    text = Text.assemble(("URL", "bold"), f"      {url}\n", ("API key", "bold"), f"  {api_key}")
    if saved_to is not None:
        text.append(f"\nsaved to {inert(saved_to)} (SDK and CLI read it)", style="dim")
    text.append(f"\nAPI docs {url}/docs", style="dim")
    text.append("\ntry `dsec demo`; stop with Ctrl-C (sandboxes run on: `dsec down", style="dim")
    text.append(" --stop-sandboxes` ends them too)", style="dim")
    out.print(Panel(text, title="DSec is up", expand=False, border_style="green"))


def up(
    ctx: typer.Context,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = DEFAULT_HOST,
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help=ANY_PORT_HELP),
    ] = DEFAULT_PORT,
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="images, sandboxes and databases")
    ] = DEFAULT_DATA_DIR,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="DSEC_API_KEY", help="admin key (default: generated and kept)"
        ),
    ] = None,
    edge_id: Annotated[
        str | None,
        typer.Option(
            "--edge-id",
            envvar="DSEC_EDGE_ID",
            help="1-16 lowercase letters and digits (default: unique per host and data dir)",
        ),
    ] = None,
    layer_store: Annotated[
        str | None,
        typer.Option(
            "--layer-store",
            help="shared layer store: http://host:port (dsec store serve), a shared "
            "directory, or an OCI registry: oci://host:port/repo (oci+http:// for plain HTTP)",
        ),
    ] = None,
    layer_store_token: Annotated[
        str | None,
        typer.Option(
            "--layer-store-token",
            help="token of the HTTP layer store; user:password for an OCI registry",
        ),
    ] = None,
    layer_cache_gib: Annotated[
        float | None, typer.Option("--layer-cache-gib", help="host layer cache budget (GiB)")
    ] = None,
    insecure_registry: Annotated[
        list[str] | None,
        typer.Option(
            "--insecure-registry",
            help="HOST:PORT of an OCI registry to pull from over plain HTTP (repeatable)",
        ),
    ] = None,
    registry_auth_file: Annotated[
        Path | None,
        typer.Option(
            "--registry-auth-file", help="registry credentials, Docker config.json format"
        ),
    ] = None,
    registry_ca_file: Annotated[
        Path | None,
        typer.Option(
            "--registry-ca-file",
            help="PEM CA bundle to verify HTTPS registries and layer stores with "
            "(default: the system CA store)",
        ),
    ] = None,
    registry_mirror: Annotated[
        list[str] | None,
        typer.Option(
            "--registry-mirror",
            help="REGISTRY=URL: try this mirror before the registry (repeatable)",
        ),
    ] = None,
    save_config: Annotated[
        bool,
        typer.Option(
            "--save-config/--no-save-config",
            help="write URL and key to ~/.config/dsec/config.json",
        ),
    ] = True,
    backends: Annotated[
        str | None,
        typer.Option(
            "--backends",
            envvar="DSEC_BACKENDS",
            help="backends to run, comma-separated (e.g. container); default: every "
            "backend this host can run (`/v1/health` says which, and why not the others)",
        ),
    ] = None,
    stop_sandboxes_on_exit: Annotated[
        bool,
        typer.Option(
            "--stop-sandboxes-on-exit",
            envvar="DSEC_STOP_SANDBOXES_ON_EXIT",
            help="stop every sandbox on Ctrl-C / SIGTERM / SIGHUP (default: they run on, and the "
            "next `dsec up` re-adopts them with their background processes)",
        ),
    ] = False,
) -> None:
    """Run apiserver, edge, store and layer store until Ctrl-C / SIGTERM / SIGHUP.

    Sandboxes outlive a shutdown (as they outlive a crash) unless asked otherwise:
    `--stop-sandboxes-on-exit`, or `dsec down --stop-sandboxes`."""
    try:
        platform = importlib.import_module("dsec.roots.platform")  # lazily: the whole server side
    except ImportError as exc:
        raise DSecError(
            f"cannot load the platform ({exc}); it needs the server extra: "
            "pip install 'dsec[server]'"
        ) from None

    config = PlatformConfig(
        data_dir=data_dir, host=host, port=port, api_key=api_key or globals_of(ctx).api_key
    )
    config.stop_sandboxes_on_exit = config.stop_sandboxes_on_exit or stop_sandboxes_on_exit
    if edge_id:
        config.edge_id = check_edge_id(edge_id)
    if layer_store is not None:
        config.layer_store = layer_store
    if layer_store_token is not None:
        config.layer_store_token = layer_store_token
    if insecure_registry:
        config.insecure_registries = [*config.insecure_registries, *insecure_registry]
    if registry_auth_file is not None:
        config.registry_auth_file = registry_auth_file
    if registry_ca_file is not None:
        config.registry_ca_file = registry_ca_file
    for mirror in registry_mirror or []:
        try:
            for reg, urls in parse_mirrors(mirror).items():
                config.registry_mirrors.setdefault(reg, []).extend(urls)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--registry-mirror") from None
    if backends is not None:
        config.backends = [b.strip() for b in backends.split(",") if b.strip()]
    if layer_cache_gib is not None:
        config.layer_cache_bytes = int(layer_cache_gib * (1 << 30))

    def ready(url: str, key: str) -> None:
        announce(url, key, save_client_config(url, key) if save_config else None)

    with serving("the platform"):
        run = getattr(platform, "run", None)  # the blocking entry point (uvloop) if provided
        if callable(run):
            run(config, ready=ready)
        else:
            asyncio.run(platform.serve(config, ready=ready))


def down(
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="data dir of the platform to stop")
    ] = DEFAULT_DATA_DIR,
    stop_sandboxes: Annotated[
        bool,
        typer.Option(
            "--stop-sandboxes",
            help="stop every sandbox too (default: they run on for the next `dsec up`)",
        ),
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait")] = 60.0,
) -> None:
    """Stop the `dsec up` running on a data dir (SIGTERM, then wait for it to end)."""
    pid = platform_pid(data_dir)
    if pid is None:
        raise DSecError(f"no platform is running on {data_dir}")
    if stop_sandboxes:
        config = PlatformConfig(data_dir=data_dir)
        config.stop_marker.parent.mkdir(parents=True, exist_ok=True)
        config.stop_marker.touch()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while platform_pid(data_dir) is not None:
        if time.monotonic() > deadline:
            raise DSecError(f"the platform (pid {pid}) did not stop within {timeout:.0f}s")
        time.sleep(0.05)
    kept = "" if stop_sandboxes else "; its sandboxes run on (`dsec up` re-adopts them)"
    out.print(f"stopped the platform (pid {pid}){kept}")


def platform_pid(data_dir: Path) -> int | None:
    """Pid of the platform holding ``data_dir``'s lock (dsec.edge.identity), or None."""
    try:
        fd = os.open(data_dir / "lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            found = re.match(rb"pid (\d+)", os.pread(fd, 512, 0))
            return int(found.group(1)) if found else None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # nobody holds it
    finally:
        os.close(fd)
