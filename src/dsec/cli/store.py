"""`dsec store serve`: the HTTP(S) layer store other hosts' edges fetch layers from."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from dsec.cli.common import ANY_PORT_HELP, out, serving

app = typer.Typer(help="The shared layer store.", no_args_is_help=True)


@app.command()
def serve(
    root: Annotated[Path, typer.Option("--root", help="store directory")] = Path(
        "/var/lib/dsec/store"
    ),
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help=ANY_PORT_HELP)] = 8471,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", envvar="DSEC_STORE_TOKEN", help="read-write token (else generated)"
        ),
    ] = None,
    read_token: Annotated[
        str | None,
        typer.Option("--read-token", envvar="DSEC_STORE_READ_TOKEN", help="read-only token"),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", help="serve HTTPS with this PEM certificate (chain)"),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", help="the PEM private key of --tls-cert")
    ] = None,
) -> None:
    """Serve content-addressed blobs (range requests), chunk indexes and layer refs."""
    from dsec.images.remote.dirstore import DirStore
    from dsec.images.remote.server import Access
    from dsec.images.remote.server import serve as serve_store

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give both --tls-cert and --tls-key", param_hint="--tls-cert")
    if token is None:
        token = "dst_" + secrets.token_urlsafe(24)
        out.print(f"store token: {token}", markup=False)
    tokens: dict[str, Access] = {token: "write"}
    if read_token:
        tokens[read_token] = "read"
    store = DirStore(root)

    def ready(url: str) -> None:
        out.print(f"layer store {url} serving {store.root} (pid {os.getpid()})", markup=False)

    tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    with serving("the layer store"):
        serve_store(store, tokens, host=host, port=port, ready=ready, tls=tls)
