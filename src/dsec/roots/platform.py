"""Composition root of `dsec up`: apiserver + edge + SQLite store + layer store.

The same components are separate processes in cluster mode; here they are wired
together in one process and one event loop, talking by method calls. What it wires:

- ``running_platform``: the host identity claim (first, so a second instance cannot
  sweep this one's sandboxes), the SQLite control store (API keys, IAM, roles), the
  images (with the shared layer store and lazy loader when configured), the cgroup
  host, the spawner, the OCI runtime, the container backend (seccomp, sandbox disk),
  the Edge (state DB, audit log, admission, network), swap, the IAM releaser and the
  FnCall service; and shuts them down in reverse, also on error;
- ``serve``: the data plane and its token signer, the trajectory service, the layer
  service, and the one ApiServices value handed to ``create_app``.

It is the only place these host services are constructed: a cluster edge
(dsec.roots.edge) is this root with a cluster token and a heartbeat companion, so the
two cannot wire a host differently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec import linux, spawn
from dsec.agent.build import agent_binary
from dsec.apiserver.creator import SandboxCreator, StopReleaser, attach_iam
from dsec.backends.base import BackendHost
from dsec.backends.registry import BackendRegistry
from dsec.config import PlatformConfig
from dsec.control.db import make_engine, migrate, sqlite_url
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.identity import HostClaim, claim_host_identity
from dsec.edge.state import EdgeStateDB
from dsec.fncall.service import FnCallService
from dsec.hostlimits import check_host
from dsec.images.images import Images
from dsec.images.oci.client import RegistrySettings
from dsec.net.manager import NetworkManager
from dsec.observe.metrics import GaugeCollector, fncall_gauges, layer_cache_gauges
from dsec.resources import cgroups
from dsec.resources.capacity import SandboxCost
from dsec.resources.disk import GiB
from dsec.resources.swap import SwapError, SwapFile, keep_sandboxes_off_swap, managed_size
from dsec.roots.serving import listening, run_loop, serve_app
from dsec.security.audit import AuditLog

log = logging.getLogger(__name__)


async def start_spawner(binary: Path, path: Path) -> spawn.HostSpawner | None:
    """Every runtime call goes through the per-host spawner (see dsec.spawn), which
    outlives us so that it reaps the inits of sandboxes we re-adopt after a crash."""
    if len(os.fsencode(path)) >= 108:  # sockaddr_un.sun_path
        log.warning("data dir path too long for the spawner socket %s; not using one", path)
        return None
    return await spawn.start_spawner(binary, path)


def load_or_create_api_key(config: PlatformConfig) -> str:
    if config.api_key:
        return config.api_key
    path = config.data_dir / "api_key"
    if path.is_file():
        return path.read_text().strip()
    key = "dsk_" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    return key


def layer_store_options(config: PlatformConfig) -> dict[str, Any]:
    """The shared layer store and lazy loader for Images, when one is configured."""
    if not config.layer_store:
        return {}
    from dsec.images.lazy.daemon import LazyDaemon
    from dsec.images.remote.client import open_remote

    remote = open_remote(
        config.layer_store, config.layer_store_token, ca_file=config.registry_ca_file
    )
    return {
        "remote": remote,
        # dsec-lazyfs reads a path or speaks HTTP(S) (verified with the same CA setting).
        "lazy": LazyDaemon(
            config.images_dir / "lazy",
            remote.location.rstrip("/"),
            config.layer_store_token,
            timeout=config.lazy_fetch_timeout,
            blob_prefix=remote.lazy_blob_prefix,
            ca_file=config.registry_ca_file,
        )
        if remote.location.startswith(("http://", "https://", "/"))
        else None,
        "cache_bytes": config.layer_cache_bytes,
    }


def registry_settings(config: PlatformConfig) -> RegistrySettings:
    """How this host pulls from OCI registries (dsec image pull)."""
    return RegistrySettings(
        auth_file=config.registry_auth_file,
        ca_file=config.registry_ca_file,
        insecure=frozenset(config.insecure_registries),
        mirrors=dict(config.registry_mirrors),
    )


@dataclass
class Platform:
    config: PlatformConfig
    edge: Edge
    images: Images
    keys: KeyStore
    api_key: str
    recovery: dict[str, list[str]]
    fncall: FnCallService | None = None
    roles: RoleStore | None = None  # builder role for pack_diff/fork (dsec.control.roles)
    iam: IAM | None = None  # projects, roles, quotas (dsec.control.iam)


@contextlib.asynccontextmanager
async def running_platform(config: PlatformConfig) -> AsyncIterator[Platform]:
    """Start every component, yield them, and shut down cleanly (also on error)."""
    if os.geteuid() != 0:
        raise PermissionError("the platform needs root (mounts, cgroups, namespaces)")
    config.data_dir.mkdir(parents=True, exist_ok=True)
    check_host(config.data_dir)  # nofile, free disk, pids: refuse or adapt (dsec.hostlimits)
    # Before anything that sweeps or cleans up: a second instance on this data dir or
    # edge id would otherwise kill the first one's sandboxes (dsec.edge.identity).
    claim = claim_host_identity(config.data_dir, config.edge_id or None, url=config.url)
    try:
        config.edge_id = claim.edge_id
        async with _running_platform(config, claim) as platform:
            yield platform
    finally:
        claim.release()  # last: shutdown cleans up under the locks too


@contextlib.asynccontextmanager
async def _running_platform(config: PlatformConfig, claim: HostClaim) -> AsyncIterator[Platform]:
    # The backends asked for (--backends), or every one this host can run: probed
    # first, so that a bad --backends fails before anything starts.
    registry = BackendRegistry()
    selection = registry.select(config.backends)
    # Orphans of what we start ourselves (the spawner's fallback path) come to us.
    linux.become_subreaper()
    with contextlib.suppress(OSError):  # a `dsec down --stop-sandboxes` this run never got
        config.stop_marker.unlink()
    engine = make_engine(sqlite_url(config.control_db))
    edge: Edge | None = None
    images: Images | None = None
    spawner: spawn.HostSpawner | None = None
    fncall: FnCallService | None = None
    releaser: StopReleaser | None = None
    iam: IAM | None = None
    swap: SwapFile | None = None
    try:
        audit = AuditLog(config.audit_db)
        network = NetworkManager.from_env(config.edge_id, config.data_dir / "run" / "net", audit)
        if network is not None:
            claim.lock_network(network.prefix, config.edge_id)
        await migrate(engine)
        keys = KeyStore(engine)
        api_key = load_or_create_api_key(config)
        await keys.ensure(api_key, principal="admin")
        iam = IAM(engine)
        await iam.ensure_bootstrap()
        roles = RoleStore(iam)
        images = Images(
            config.images_dir,
            engine,
            registries=registry_settings(config),
            build_cache=config.build_cache_dir,
            **layer_store_options(config),
        )
        await images.open()
        host = cgroups.detect()
        if config.tune_host:
            await asyncio.to_thread(cgroups.favor_dynamic_modifications, host)
        wrapper = await asyncio.to_thread(agent_binary)
        spawner = await start_spawner(wrapper, config.data_dir / "run" / "spawner.sock")
        backends = registry.build(
            selection,
            BackendHost(
                config=config, layers=images.mounts, cgroups=host, audit=audit, agent_binary=wrapper
            ),
        )
        edge = Edge(
            edge_id=config.edge_id,
            backends=backends,
            unavailable=selection.unavailable,
            images=images,
            state=EdgeStateDB(config.edge_db),
            audit=audit,
            admission=Admission(
                max_sandboxes=config.max_sandboxes,
                memory_overcommit=config.memory_overcommit,
                cpu_overcommit=config.cpu_overcommit,
                cost=SandboxCost(
                    host_memory_bytes=config.sandbox_host_cost_kb * 1024,
                    edge_fds=max(1, config.sandbox_edge_fds),
                ),
                pressure_limit=config.admission_pressure,
            ),
            network=network,
            data_dir=config.data_dir,
            idle_reclaim_seconds=config.idle_reclaim_seconds,
            reclaim_pressure=config.reclaim_pressure,
            resume_prefetch=config.resume_prefetch,
            warm_per_shape=config.warm_per_shape,
            warm_shapes=config.warm_shapes,
            warm_idle_seconds=config.warm_idle_seconds,
            warm_grace_seconds=config.warm_grace_seconds,
        )
        swap = await asyncio.to_thread(start_swap, config, host)
        recovery = await edge.start()
        releaser = await attach_iam(edge, iam)  # charges released whenever a sandbox ends
        fncall = FnCallService(
            images=images,
            cgroups=host,
            run_dir=config.data_dir / "run" / "fncall",
            edge_id=config.edge_id,
            audit=audit,
        )
        await fncall.start()
        yield Platform(config, edge, images, keys, api_key, recovery, fncall, roles, iam)
    finally:
        stop_all = stop_sandboxes_on_exit(config)
        if fncall is not None:
            await fncall.close()
        if edge is not None:
            edge.stop_on_close = stop_all
            await edge.close()
        if swap is not None:  # after the sandboxes are gone: fewer pages to swap back in
            await asyncio.to_thread(swap.remove if swap.managed else swap.disable)
        if releaser is not None:
            await releaser.drain()
        if iam is not None:
            await iam.close()
        if spawner is not None:
            # Sandboxes that live on keep their reaping parent, as after a crash; with
            # none left (all stopped, or none made) nothing is left running either.
            await asyncio.to_thread(spawner.stop if stop_all else spawner.stop_if_idle)
        if images is not None:
            # With no sandbox left, no layer of this host is in use, whatever was counted.
            await images.close(nothing_live=edge is None or not edge.sandboxes_live())
        await engine.dispose()


def stop_sandboxes_on_exit(config: PlatformConfig) -> bool:
    """Whether this shutdown ends every sandbox: the option, or a `dsec down
    --stop-sandboxes` (its marker is consumed). Otherwise they run on (live restore)."""
    marker = config.stop_marker
    asked = marker.exists()
    with contextlib.suppress(OSError):
        marker.unlink()
    return config.stop_sandboxes_on_exit or asked


def start_swap(config: PlatformConfig, host: cgroups.CgroupHost) -> SwapFile | None:
    """The swap job pauses push anonymous memory into (dsec.resources.swap): the
    operator's file (DSEC_SWAP_FILE), or by default the platform's own below the data
    dir (DSEC_SWAP=auto; off: none). A file that cannot be used is logged and skipped:
    pauses then keep anonymous memory in RAM and say so (``swap_available=False``)."""
    if config.swap_file is not None:
        swap = SwapFile(config.swap_file, config.swap_gb * GiB, loop=config.swap_loop)
    elif config.swap == "auto":
        path = config.managed_swap_file
        size = managed_size(path.parent, config.swap_gb * GiB)
        if size < 64 << 20:
            log.warning("no platform swap: too little free disk below %s", path.parent)
            return None
        swap = SwapFile(path, size, loop=config.swap_loop, managed=True)
    else:
        return None
    try:
        swap.check_location([config.sandboxes_dir, config.sandbox_disk_image, config.images_dir])
        swap.enable()
    except (SwapError, OSError) as exc:
        log.error("swap file %s not used: %s", swap.path, exc)
        if swap.managed:
            with contextlib.suppress(OSError):
                swap.remove()
        return None
    keep_sandboxes_off_swap(host, f"dsec/{config.edge_id}")
    return swap


async def serve(
    config: PlatformConfig,
    *,
    ready: Callable[[str, str], None] | None = None,
    companion: Callable[[Platform], Awaitable[None]] | None = None,
) -> None:
    """Serve the HTTP API until SIGINT/SIGTERM/SIGHUP, then stop every sandbox and unmount.

    ``companion`` runs beside the server once it listens (a cluster edge's heartbeats,
    dsec.cluster.node) and is cancelled before the platform shuts down."""
    sock, config = listening(config)  # a taken port fails here, before any work
    with contextlib.closing(sock):
        await _serve_platform(config, sock, ready, companion)


async def _serve_platform(
    config: PlatformConfig,
    sock: socket.socket,
    ready: Callable[[str, str], None] | None,
    companion: Callable[[Platform], Awaitable[None]] | None,
) -> None:
    from dsec.apiserver.app import create_app
    from dsec.apiserver.services import ApiServices
    from dsec.edge.dataplane import DataPlane
    from dsec.edge.tokens import TokenSigner, load_or_create_key

    async with running_platform(config) as platform, contextlib.AsyncExitStack() as stack:
        signer = TokenSigner(
            load_or_create_key(config.data_dir / "edge_token.key"), ttl=config.token_ttl
        )
        dataplane = DataPlane(platform.edge, signer, config.url)
        # Live restore: background processes of re-adopted sandboxes are followed again;
        # on the way out they are left to their agents (the sandboxes may live on).
        await dataplane.restore(platform.recovery["adopted"])
        stack.push_async_callback(dataplane.close)
        from dsec.rl.trajectory import TrajectoryLog, TrajectoryService

        trajectory_log = TrajectoryLog(config.data_dir / "trajectory.db")
        stack.callback(trajectory_log.close)
        platform.edge.trajectory = TrajectoryService(platform.edge, trajectory_log, dataplane)
        from dsec.rollouts.listener import ListenerKeeper
        from dsec.rollouts.manager import RolloutManager
        from dsec.rollouts.store import RolloutStore

        iam_ = platform.iam if config.quotas else None
        creator = SandboxCreator(platform.edge, iam=iam_)
        rollout_store = RolloutStore(config.data_dir / "rollouts.db")
        stack.callback(rollout_store.close)
        rollouts = RolloutManager(
            platform.edge,
            dataplane,
            platform.edge.trajectory,
            rollout_store,
            creator,
            fncall=platform.fncall,
            # Held model calls survive this process (dsec.rollouts.listener).
            listener=ListenerKeeper(config.data_dir / "run" / "gateway.sock"),
            keep_listener=not config.stop_sandboxes_on_exit,
        )
        # Hosted rollouts go on after a restart; stopped (not ended) on the way out.
        await rollouts.start()
        stack.push_async_callback(rollouts.close)
        from dsec.images.layers import LayerService

        iam = platform.iam if config.quotas else None
        layers = LayerService(platform.images)
        metrics = platform.edge.metrics
        metrics.add(GaugeCollector(lambda: layer_cache_gauges(layers.cache_report())))
        if platform.fncall is not None:
            fncall = platform.fncall
            fncall.on_wait = metrics.fncall_waited
            metrics.add(GaugeCollector(lambda: fncall_gauges(fncall.pools_info())))
        app = create_app(
            ApiServices(
                edge=platform.edge,
                keys=platform.keys,
                images=platform.images,
                dataplane=dataplane,
                layers=layers,
                audit=platform.edge.audit,
                fncall=platform.fncall,
                trajectory=platform.edge.trajectory,
                roles=platform.roles,
                rl=platform.edge,
                creator=creator,
                rollouts=rollouts,
                iam=iam,
                report_load=platform.edge.admission if config.report_load else None,
                metrics=metrics,
            )
        )

        async def started() -> None:
            if ready is not None:
                ready(config.url, platform.api_key)
            if companion is not None:
                await companion(platform)

        await serve_app(app, sock, started)


def run(
    config: PlatformConfig,
    *,
    ready: Callable[[str, str], None] | None = None,
    companion: Callable[[Platform], Awaitable[None]] | None = None,
) -> None:
    """Blocking entry point; uses uvloop when installed."""
    run_loop(serve(config, ready=ready, companion=companion))
