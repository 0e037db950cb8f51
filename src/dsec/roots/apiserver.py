"""Composition root of `dsec apiserver`: the cluster's public API (any number of them).

Wires, once, what a cluster apiserver serves: the control database (reached and
migrated), the API keys, IAM with its quotas and roles, the edge Registry (which
releases and re-charges quota as edges come and go), the ClusterEdge that routes each
call to its edge, the fan-outs for what every edge keeps for itself (audit log,
trajectory log, FnCall pools), and the batch limits of a cluster; then hands them to
``create_app`` as one ApiServices value and adds the edges' heartbeat routes. It holds
no sandboxes: everything per sandbox is asked of the edges. This is the only place
these cluster services are constructed, so their lifetimes (start, close, dispose)
are in one try/finally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dsec.api.sandbox import SandboxInfo
from dsec.apiserver.app import API_VERSION, create_app
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.cluster import cluster_router
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.services import ApiServices, BatchLimits
from dsec.cluster.fanout import ClusterAudit, ClusterTrajectories
from dsec.cluster.fncall import ClusterFnCall
from dsec.cluster.registry import Registry
from dsec.cluster.rollouts import ClusterRollouts
from dsec.cluster.router import ClusterEdge
from dsec.control.db import check_reachable, database_url, make_engine, migrate
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.errors import QuotaExceeded
from dsec.roots.serving import listening, run_loop, serve_app

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
    sock, config = listening(config)  # a taken port fails here, before any work
    with contextlib.closing(sock):
        await _serve_apiserver(config, sock, ready)


async def _serve_apiserver(
    config: ApiserverConfig, sock: socket.socket, ready: Callable[[str], None] | None
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
        fncall = ClusterFnCall(router)
        await fncall.start()
        creator = SandboxCreator(router, iam=iam)
        app = create_app(
            ApiServices(
                edge=router,
                keys=keys,
                # What each edge keeps for itself (audit log, trajectory log, FnCall
                # pools), asked of the edges: routed by sandbox id or fanned out
                # (dsec.cluster.fanout).
                audit=ClusterAudit(router),
                fncall=fncall,
                trajectory=ClusterTrajectories(router),
                roles=RoleStore(iam),
                rl=router,
                # File bodies of the control routes go to the sandbox's edge.
                streams=router,
                # E2B's envd and per-sandbox calls go to the sandbox's edge.
                relay=router,
                creator=creator,
                # Hosted rollouts: the agent sandbox made here, the rollout on its edge.
                rollouts=ClusterRollouts(router, creator),
                iam=iam,
                batches=cluster_batch_limits(),
                metrics=router.metrics,
            )
        )
        auth = Authenticator(keys)
        access: SandboxAccess = app.state.sandbox_access  # the app's one sandbox check
        app.include_router(cluster_router(router, registry, config.cluster_token, auth, access))

        async def started() -> None:
            if ready is not None:
                ready(config.url)

        await serve_app(app, sock, started)
    finally:
        if fncall is not None:
            await fncall.close()
        if router is not None:
            await router.close()
        if iam is not None:
            await iam.close()
        await engine.dispose()


def cluster_batch_limits() -> BatchLimits:
    """Here a create is a request to some edge, not CPU of this host: batches may keep
    many in flight (the edges admit or refuse each), unless DSEC_BATCH_PARALLELISM
    says otherwise."""
    if "DSEC_BATCH_PARALLELISM" in os.environ:
        return BatchLimits()
    return BatchLimits(
        parallelism=CLUSTER_BATCH_PARALLELISM, max_in_flight=4 * CLUSTER_BATCH_PARALLELISM
    )


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
