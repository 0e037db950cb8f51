"""The cluster's processes: `dsec apiserver`, `dsec watcher` and `dsec edge --join`.

Each is the same code as `dsec up`, wired differently: the apiserver serves the public
API over a ClusterEdge (no sandboxes of its own, any number of instances), the watcher
only probes, and an edge is a `dsec up` whose API key is the cluster token and which
beats to the apiservers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dsec.api.sandbox import SandboxInfo
from dsec.apiserver.app import API_VERSION, create_app
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.cluster import cluster_router
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.fncall import fncall_router
from dsec.apiserver.security import security_router
from dsec.apiserver.trajectory import trajectory_router
from dsec.cluster.fanout import ClusterAudit, ClusterTrajectories
from dsec.cluster.fncall import ClusterFnCall
from dsec.cluster.node import EdgeNode
from dsec.cluster.registry import Registry
from dsec.cluster.router import ClusterEdge
from dsec.cluster.watcher import Watcher
from dsec.config import PlatformConfig
from dsec.control.db import check_reachable, database_url, make_engine, migrate
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.errors import QuotaExceeded
from dsec.platform import Platform, run, run_loop, serve_app

log = logging.getLogger(__name__)

CLUSTER_BATCH_PARALLELISM = 64


@dataclass
class ApiserverConfig:
    db: str
    cluster_token: str
    admin_key: str
    host: str = "127.0.0.1"
    port: int = 8470
    refresh: float = 0.25

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


async def serve_apiserver(
    config: ApiserverConfig, *, ready: Callable[[str], None] | None = None
) -> None:
    engine = make_engine(database_url(config.db))
    router: ClusterEdge | None = None
    fncall: ClusterFnCall | None = None
    iam: IAM | None = None
    try:
        await check_reachable(engine)
        await migrate(engine)  # idempotent; concurrent apiservers serialise on a lock
        keys = KeyStore(engine)
        await keys.ensure(config.admin_key, principal="admin")
        iam = IAM(engine)
        await iam.ensure_bootstrap()
        registry = Registry(engine, release=iam.release_many, recharge=recharger(iam))
        router = ClusterEdge(
            registry, config.cluster_token, version=API_VERSION, refresh=config.refresh
        )
        await router.start()
        app = create_app(
            router,
            None,
            keys,
            creator=SandboxCreator(router, iam=iam),
            iam=iam,
            roles=RoleStore(iam),
        )
        auth = Authenticator(keys)
        app.include_router(cluster_router(router, registry, config.cluster_token, auth))
        # What each edge keeps for itself (audit log, trajectory log, FnCall pools),
        # asked of the edges: routed by sandbox id or fanned out (dsec.cluster.fanout).
        app.include_router(security_router(ClusterAudit(router), auth))
        app.include_router(trajectory_router(ClusterTrajectories(router), auth))
        fncall = ClusterFnCall(router)
        await fncall.start()
        app.include_router(fncall_router(fncall, auth))
        if "DSEC_BATCH_PARALLELISM" not in os.environ:
            # Here a create is a request to some edge, not CPU of this host: batches
            # may keep many in flight (the edges admit or refuse each).
            app.state.batches.default_parallelism = CLUSTER_BATCH_PARALLELISM
            app.state.batches.max_in_flight = 4 * CLUSTER_BATCH_PARALLELISM

        async def started() -> None:
            if ready is not None:
                ready(config.url)

        await serve_app(app, config.host, config.port, started)
    finally:
        if fncall is not None:
            await fncall.close()
        if router is not None:
            await router.close()
        if iam is not None:
            await iam.close()
        await engine.dispose()


def recharger(iam: IAM) -> Callable[[list[SandboxInfo]], Awaitable[list[str]]]:
    """Charge re-adopted sandboxes again; the ones that no longer fit are stopped."""

    async def recharge(infos: list[SandboxInfo]) -> list[str]:
        over: list[str] = []
        for info in infos:
            project = info.spec.project or iam.default
            try:
                await iam.charge(
                    project, info.id, info.spec.cpu_cores_limit, info.spec.memory_limit_mb
                )
            except QuotaExceeded:
                over.append(info.id)
        return over

    return recharge


def run_apiserver(config: ApiserverConfig, *, ready: Callable[[str], None] | None = None) -> None:
    run_loop(serve_apiserver(config, ready=ready))


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
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
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


@dataclass
class EdgeJoin:
    join: list[str]
    cluster_token: str
    labels: dict[str, str] = field(default_factory=dict)
    interval: float = 0.5  # with the router's 0.25 s refresh: placement views <= 0.75 s old


def run_edge(
    config: PlatformConfig, join: EdgeJoin, *, ready: Callable[[str, str], None] | None = None
) -> None:
    """A `dsec up` that answers to the cluster token and beats to the apiservers."""
    config.api_key = join.cluster_token
    config.quotas = False  # the apiservers charge every create before it gets here
    config.report_load = True  # their placement reads it (dsec.control.placement)

    async def member(platform: Platform) -> None:
        node = EdgeNode(
            platform.edge,
            platform.images,
            join=join.join,
            token=join.cluster_token,
            url=config.url,
            labels=join.labels,
            lazy=bool(config.layer_store),
            interval=join.interval,
        )
        await node.run()

    run(config, ready=ready, companion=member)
