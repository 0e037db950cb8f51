"""Composition root of `dsec watcher`: the cluster's prober, and nothing else.

Wires the control database (reached and migrated) into a Registry and a Watcher
(dsec.cluster.watcher), and runs it until SIGINT/SIGTERM/SIGHUP. The watcher serves no API
and holds no sandboxes, so this is all it needs; it is the only place that builds a
Watcher, so probe period and thresholds are set from one config.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from dsec.cluster.registry import Registry
from dsec.cluster.watcher import Watcher
from dsec.control.db import check_reachable, database_url, make_engine, migrate
from dsec.roots.serving import run_loop, stop_signals


@dataclass
class WatcherConfig:
    db: str
    period: float = 1.0
    failures: int = 3
    stale_after: float = 5.0


async def serve_watcher(config: WatcherConfig, *, ready: Callable[[], None] | None = None) -> None:
    engine = make_engine(database_url(config.db))
    try:
        await check_reachable(engine)
        await migrate(engine)
        watcher = Watcher(
            Registry(engine),
            period=config.period,
            failures=config.failures,
            stale_after=config.stale_after,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.create_task(watcher.run())
        if ready is not None:
            ready()
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await engine.dispose()


def run_watcher(config: WatcherConfig, *, ready: Callable[[], None] | None = None) -> None:
    run_loop(serve_watcher(config, ready=ready))
