"""The figures `dsec demo` prints that a user can compare with other systems.

The demo's concurrent phase shows burst behaviour, but its per-sandbox create times
are queueing times (20 creates on 2 cores wait for each other), which read as slow.
So, measured in the same run on the same host: sequential create p50/p99 (busybox,
64 MiB), exec p50/p99 of ``run_shell("true")`` on one sandbox, and the host's raw
``crun run`` on the same EROFS layer (dsec.crun_baseline), with create / raw as a
ratio. The raw baseline needs local root and the layer's blob; where either is
missing a one-line note says so instead of a number.

Creates of one shape are served by warm sandboxes (dsec.edge.warmpool) when one is
ready, which is what a user's loop of creates sees; creates of a shape not seen before
start their own container, and are shown apart ("cold"), so neither figure hides the
other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from rich.table import Table

from dsec.api.spec import DSecContainerRunArgs
from dsec.cli.common import cell, out, percentile
from dsec.sdk import DSecClient

TIMING_IMAGE = "busybox:latest"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Timings:
    """Milliseconds per operation; ``raw_note`` says why there is no raw figure."""

    create_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    exec_ms: list[float] = field(default_factory=list)
    raw_ms: list[float] = field(default_factory=list)
    raw_note: str | None = None
    burst_n: int = 0
    burst_s: float = 0.0

    @property
    def burst_rate(self) -> float | None:
        """Sandboxes per second of the concurrent phase, None if it created none."""
        return self.burst_n / self.burst_s if self.burst_n and self.burst_s > 0 else None

    @property
    def ratio(self) -> float | None:
        """Sequential create p50 over raw crun p50, None without both."""
        return self._over_raw(self.create_ms)

    @property
    def cold_ratio(self) -> float | None:
        """Cold create p50 (a shape not seen before) over raw crun p50."""
        return self._over_raw(self.cold_ms)

    def _over_raw(self, samples: list[float]) -> float | None:
        if not samples or not self.raw_ms:
            return None
        return percentile(samples, 50) / percentile(self.raw_ms, 50)


def is_local(url: str) -> bool:
    """Whether the platform at ``url`` runs on this host (the raw baseline is only a
    comparison when measured on the same machine)."""
    return (urlsplit(url).hostname or "") in LOOPBACK


async def measure_platform(
    client: DSecClient, timings: Timings, *, creates: int, execs: int, warmup: int = 3
) -> None:
    """Sequential creates (each stopped right after, untimed) and ``run_shell("true")``
    on one sandbox, after ``warmup`` untimed creates and execs. Every sandbox made is
    stopped, also on failure."""
    spec = DSecContainerRunArgs(
        container_image=TIMING_IMAGE, memory_limit_mb=64, ttl_running_stop=600
    )
    for _ in range(warmup):
        await (await client.run_container(spec)).stop()
    for _ in range(creates):
        t = time.perf_counter()
        sandbox = await client.run_container(spec)
        timings.create_ms.append((time.perf_counter() - t) * 1000)
        await sandbox.stop()
    for i in range(creates):  # each a shape of its own: no warm sandbox can serve it
        cold = spec.model_copy(update={"env": {"DSEC_DEMO_SHAPE": str(i)}})
        await asyncio.sleep(0.05)  # the previous one's warm refill runs now, not beside it
        t = time.perf_counter()
        sandbox = await client.run_container(cold)
        timings.cold_ms.append((time.perf_counter() - t) * 1000)
        await sandbox.stop()
    sandbox = await client.run_container(spec)
    try:
        for _ in range(warmup):
            await sandbox.run_shell("true")
        for _ in range(execs):
            t = time.perf_counter()
            await sandbox.run_shell("true")
            timings.exec_ms.append((time.perf_counter() - t) * 1000)
    finally:
        with contextlib.suppress(Exception):
            await sandbox.stop()


def find_blob(digest: str, data_dirs: Sequence[Path]) -> Path | None:
    """The layer's blob in the first data dir that has it (blobs are content-addressed:
    any local platform's copy is the same bytes)."""
    from dsec.crun_baseline import blob_path

    for data_dir in data_dirs:
        path = blob_path(data_dir, digest)
        if path.is_file():
            return path
    return None


async def measure_raw(
    timings: Timings, url: str, layers: Sequence[str], data_dirs: Sequence[Path], runs: int
) -> None:
    """The host's raw `crun run` on the timing image's layer, or a note why not."""
    from dsec.crun_baseline import RawCrun, unavailable

    if not is_local(url):
        timings.raw_note = f"the platform at {url} is not on this host"
        return
    if len(layers) != 1:
        timings.raw_note = f"{TIMING_IMAGE} has {len(layers)} layers, the baseline mounts one"
        return
    blob = find_blob(layers[0], data_dirs)
    if blob is None:
        timings.raw_note = "the layer blob is not reachable from here"
        return
    why = unavailable(blob)
    if why is not None:
        timings.raw_note = why
        return

    def run() -> list[float]:
        with RawCrun(blob) as raw:
            return raw.measure(runs, warmup=3)

    timings.raw_ms = [s * 1000 for s in await asyncio.to_thread(run)]


def show_timings(timings: Timings) -> None:
    """One compact table: what the platform took, next to raw crun on this host."""
    table = Table(header_style="bold", box=None, title_justify="left")
    table.add_column("measured in this run")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    table.add_column("n", justify="right")
    rows: list[tuple[str, list[float]]] = [
        ("create, sequential (busybox, 64 MiB)", timings.create_ms),
        ("create, each a new shape (cold: no warm one)", timings.cold_ms),
        ('exec run_shell("true"), one sandbox', timings.exec_ms),
        ("raw crun run, same layer (baseline)", timings.raw_ms),
    ]
    for label, samples in rows:
        if samples:
            table.add_row(
                label,
                f"{percentile(samples, 50):.1f}",
                f"{percentile(samples, 99):.1f}",
                str(len(samples)),
            )
    if table.row_count:
        out.print(table)
    if timings.ratio is not None:
        cold = timings.cold_ratio
        out.print(
            f"create / raw crun (p50): {timings.ratio:.2f}x"
            + (f", cold {cold:.2f}x" if cold is not None else "")
        )
    elif timings.raw_note:
        out.print(cell(f"raw crun baseline: skipped ({timings.raw_note})", style="yellow"))
    if timings.burst_rate is not None:
        out.print(
            f"burst: {timings.burst_n} concurrent creates in {timings.burst_s:.2f} s = "
            f"{timings.burst_rate:.1f} sandboxes/s"
        )
