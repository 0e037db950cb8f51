"""`dsec apiserver`, `dsec watcher`, `dsec edge --join` and `dsec cluster edges`.

The three processes of cluster mode (docs/CLUSTER.md); `dsec up` keeps running all of
it in one process. The cluster token is a shared secret between apiservers and
edges: pass it by option or ``DSEC_CLUSTER_TOKEN``, never on a shared command line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli.common import (
    ANY_PORT_HELP,
    cells,
    emit_json,
    err,
    out,
    parse_pairs,
    serving,
    sync_client,
)
from dsec.config import DEFAULT_DATA_DIR, PlatformConfig
from dsec.errors import InvalidArgument

app = typer.Typer(help="Cluster mode: the edges of a cluster.", no_args_is_help=True)

DbOpt = Annotated[
    str,
    typer.Option(
        "--db", envvar="DSEC_DB", help="control database: postgresql://user@host/db (cluster)"
    ),
]
TokenOpt = Annotated[
    str,
    typer.Option(
        "--cluster-token", envvar="DSEC_CLUSTER_TOKEN", help="secret shared by apiservers and edges"
    ),
]


def _check_token(token: str) -> str:
    if len(token) < 16:
        raise InvalidArgument("the cluster token must be at least 16 characters")
    return token


def apiserver(
    db: DbOpt,
    cluster_token: TokenOpt,
    admin_key: Annotated[
        str, typer.Option("--admin-key", envvar="DSEC_API_KEY", help="the admin principal's key")
    ],
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help=ANY_PORT_HELP),
    ] = 8470,
) -> None:
    """Serve the public API over every edge of the cluster (run as many as you like)."""
    from dsec.roots.apiserver import ApiserverConfig, run_apiserver

    config = ApiserverConfig(
        db=db,
        cluster_token=_check_token(cluster_token),
        admin_key=admin_key,
        host=host,
        port=port,
    )
    with serving("the apiserver"):
        run_apiserver(config, ready=lambda url: out.print(f"apiserver listening on {url}"))


def watcher(
    db: DbOpt,
    period: Annotated[
        float, typer.Option("--period", min=0.05, help="seconds between probes")
    ] = 1.0,
    failures: Annotated[
        int, typer.Option("--failures", min=1, help="failed probes to mark down")
    ] = 3,
    stale_after: Annotated[
        float, typer.Option("--stale-after", min=0.1, help="heartbeat age (s) to mark down")
    ] = 5.0,
) -> None:
    """Probe every edge; mark the ones that stopped answering down (their sandboxes lost)."""
    from dsec.roots.watcher import WatcherConfig, run_watcher

    config = WatcherConfig(db=db, period=period, failures=failures, stale_after=stale_after)
    try:
        run_watcher(config, ready=lambda: out.print("watcher running"))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def edge(
    join: Annotated[
        list[str], typer.Option("--join", help="apiserver URL to beat to (repeatable)")
    ],
    cluster_token: TokenOpt,
    edge_id: Annotated[
        str,
        typer.Option(
            "--edge-id", envvar="DSEC_EDGE_ID", help="unique: 1-16 lowercase letters and digits"
        ),
    ],
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "0.0.0.0",
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help=ANY_PORT_HELP),
    ] = 8471,
    advertise: Annotated[
        str | None,
        typer.Option("--advertise", help="URL apiservers and SDKs reach this edge at"),
    ] = None,
    data_dir: Annotated[Path, typer.Option("--data-dir")] = DEFAULT_DATA_DIR,
    label: Annotated[
        list[str], typer.Option("--label", help="KEY=VALUE edge label (placement selectors)")
    ] = [],  # noqa: B006
    max_sandboxes: Annotated[int | None, typer.Option("--max-sandboxes", min=0)] = None,
    layer_store: Annotated[str | None, typer.Option("--layer-store")] = None,
) -> None:
    """Run sandboxes for a cluster: a `dsec up` that joins the apiservers."""
    import re

    from dsec.api.cluster import EDGE_ID_PATTERN
    from dsec.roots.edge import EdgeJoin, run_edge

    if not re.match(EDGE_ID_PATTERN, edge_id):
        raise InvalidArgument(f"--edge-id {edge_id!r} must match {EDGE_ID_PATTERN}")
    if host in ("0.0.0.0", "::") and advertise is None:
        raise InvalidArgument("listening on all addresses: say where to reach it (--advertise)")
    config = PlatformConfig(data_dir=data_dir, host=host, port=port, edge_id=edge_id)
    config.public_url = advertise
    if max_sandboxes is not None:
        config.max_sandboxes = max_sandboxes
    if layer_store is not None:
        config.layer_store = layer_store
    join_cfg = EdgeJoin(
        join=join, cluster_token=_check_token(cluster_token), labels=parse_pairs(label, "--label")
    )
    with serving(f"edge {edge_id}"):
        run_edge(
            config, join_cfg, ready=lambda url, _key: out.print(f"edge {edge_id} serving at {url}")
        )


@app.command("edges")
def edges(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """The cluster's edges: status, heartbeat age, sandboxes and capacity."""
    with sync_client(ctx) as client:
        items = client.edges()
    if as_json:
        emit_json(items)
        return
    if not items:
        err.print("no edges have joined yet")
        return
    table = Table("edge", "status", "url", "beat", "sandboxes", "capacity", "reason", box=None)
    now = time.time()
    for e in items:
        table.add_row(
            *cells(
                e.edge_id,
                e.status,
                e.url,
                f"{now - e.heartbeat_at:.1f}s",
                e.report.sandboxes,
                e.report.capacity,
                e.down_reason or "",
                limit=512,
            )
        )
    out.print(table)
