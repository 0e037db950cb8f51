"""`dsec top`: live sandboxes and what they use, refreshed in the terminal.

One ``GET /v1/stats`` per refresh (a cluster apiserver asks every edge); CPU is the
change of each sandbox's ``cpu_seconds`` between two refreshes. Every string a client
or sandbox chose (ids, images, jobs) is shown inert (dsec.security.safe_text).
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from dsec.api.sandbox import SandboxStats
from dsec.cli.common import cells, emit_json, out, sync_client

MiB = 1 << 20


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def render(rows: list[SandboxStats], cpu: dict[str, float]) -> Table:
    """The table of one refresh; ``cpu``: percent of one core per sandbox id."""
    now = datetime.now(UTC)
    table = Table(
        "sandbox", "state", "backend", "image", "job", "age", "idle", "cpu%", "mem MiB",
        "disk MiB", box=None, title=f"{len(rows)} live sandboxes",
    )  # fmt: skip
    for r in sorted(rows, key=lambda r: (-(cpu.get(r.id) or 0.0), r.id)):
        share = cpu.get(r.id)
        table.add_row(
            *cells(
                r.id,
                r.state.value,
                r.backend.value,
                r.image,
                r.job_id or "-",
                _age((now - r.created_at).total_seconds()),
                _age(r.idle_seconds),
                "-" if share is None else f"{share:.1f}",
                _mib(r.memory_bytes),
                _mib(r.disk_bytes),
            )
        )
    return table


def cpu_shares(
    before: dict[str, tuple[float, float]], rows: list[SandboxStats], now: float
) -> dict[str, float]:
    """Percent of one core each sandbox used since ``before`` (id -> (time, cpu_seconds)),
    which is updated to ``now``."""
    shares: dict[str, float] = {}
    for r in rows:
        if r.cpu_seconds is None:
            continue
        prev = before.get(r.id)
        if prev is not None and now > prev[0]:
            shares[r.id] = max(0.0, 100 * (r.cpu_seconds - prev[1]) / (now - prev[0]))
        before[r.id] = (now, r.cpu_seconds)
    for gone in set(before) - {r.id for r in rows}:
        del before[gone]
    return shares


def top(
    ctx: typer.Context,
    interval: Annotated[float, typer.Option("--interval", "-n", min=0.2, help="seconds")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="print one snapshot and exit")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="with --once: the rows as JSON")] = False,
) -> None:
    """Live sandboxes: state, image, job, age, idle time, CPU, memory, disk."""
    before: dict[str, tuple[float, float]] = {}
    with sync_client(ctx) as client:
        if once:
            rows = client.stats()
            if as_json:
                emit_json(rows)
            else:
                out.print(render(rows, {}))
            return
        with contextlib.suppress(KeyboardInterrupt), Live(console=out, auto_refresh=False) as live:
            while True:
                rows = client.stats()
                live.update(render(rows, cpu_shares(before, rows, time.monotonic())), refresh=True)
                time.sleep(interval)
