"""Container backend: crun + EROFS layers + per-sandbox overlayfs + the native agent.

Create = listening agent socket -> config.json -> ``crun run --detach`` through the
wrapper, which mounts the overlay (shared EROFS layers below, a private upper) in
crun's own mount namespace, never on the host, and puts the socket at fd 3. The
overlay therefore vanishes with the sandbox's last process, and the host mount table
does not grow with the number of sandboxes (each new mount namespace copies it, so a
host mount per sandbox made every create O(N)). The agent is pid 1:
it reaps zombies and serves exec/file requests on that socket (~1 ms round trip,
flat in the number of sandboxes, no per-sandbox host process). Every command runs as
a child of pid 1, so it inherits all of the sandbox's confinement by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Self

from dsec import linux, spawn
from dsec.api.events import AuditKind
from dsec.api.spec import BackendKind, DSecContainerRunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.backends.agentpath import AgentDataPath
from dsec.backends.base import (
    Backend,
    BackendHost,
    Capability,
    CreateInput,
    PackedWritable,
    ReclaimFigures,
    SandboxRecord,
)
from dsec.backends.container import freezer, verifier
from dsec.backends.container.facts import ContainerFacts
from dsec.backends.container.initwatch import InitChannels
from dsec.backends.container.oci_spec import AGENT_PATH_IN_SANDBOX, build_config
from dsec.backends.container.runtime import OCIRuntime
from dsec.backends.container.sharedsys import SharedSys
from dsec.errors import BackendError, LimitExceeded, Unsupported
from dsec.images.mounts import LayerMounts
from dsec.net.oci import net_mounts
from dsec.resources import oom, qos
from dsec.resources.cgroups import CgroupHost
from dsec.resources.disk import GiB, MiB, SandboxDisk
from dsec.resources.lowprio import LowPriorityPool
from dsec.security import protected as protected_paths
from dsec.security.audit import AuditSink, NullAudit
from dsec.security.init_signals import InitSignalWatcher
from dsec.security.limits import LimitReading, read_cgroup_counters
from dsec.security.seccomp import SeccompGuard
from dsec.supervise import keep_running
from dsec.threads import undo_to_the_end

log = logging.getLogger(__name__)

# AF_UNIX paths are limited to 108 bytes including the NUL.
MAX_SOCKET_PATH = 107


def container_spec(rec: SandboxRecord | CreateInput) -> DSecContainerRunArgs:
    """``rec``'s spec as the container spec it is. The edge hands this backend container
    specs only (dsec.backends.registry), so another kind here is a platform bug, not bad
    input."""
    if not isinstance(rec.spec, DSecContainerRunArgs):
        raise BackendError(
            f"sandbox {rec.id} has a {rec.spec.backend} spec: the container backend cannot run it"
        )
    return rec.spec


def prewarm_tree(root: Path, limit: int) -> int:
    """Bring up to ``limit`` bytes of regular files under ``root`` into the page cache
    (readahead in the caller's context, so the caller's cgroup is charged)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                if total + size > limit:
                    return total
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                total += size
            except OSError:
                pass
            finally:
                os.close(fd)
    return total


def _host_mounted(path: Path) -> bool:
    """ismount (two stats) first: reading the mount table costs more on a busy host."""
    return os.path.ismount(path) and linux.is_mounted(path)


def drop_page_charges(cgroups: CgroupHost, rel: str) -> None:
    """Reclaim the pages still charged to an emptied sandbox cgroup, and only those.

    Pages (page cache, anonymous) are what keeps a removed memcg alive as a dying one.
    They are counted in ``memory.stat``; ``usage - kmem`` also counts the charges each
    CPU holds in advance for the cgroup (up to 64 pages per CPU), which its removal
    drains anyway, and kernel objects (dentries, inodes: reparented at removal). Here,
    right after the kill, memory.stat said no page was left in every teardown measured,
    while usage - kmem was 16-430 KiB: the zero limit written for it reclaimed nothing
    and cost ~6.1 ms of CPU a teardown (v1's reclaim retries while any charge is left),
    the largest part of a stop and CPU taken from the next create. So: no page, no
    reclaim; otherwise a zero limit, which reclaims page batches until a pass frees
    nothing (EBUSY, expected: kernel objects are left); force_empty only if a page is
    still charged after that."""
    memory = cgroups.v1.get("memory")
    if memory is None:
        cgroups.drop_charges(rel)
        return
    d = memory / rel.strip("/")

    def pages_left() -> bool:
        return v1_pages_charged(d) > 0

    try:
        if not pages_left():
            return
        with contextlib.suppress(OSError):
            (d / "memory.limit_in_bytes").write_text("0")
        if not pages_left():
            return
    except (OSError, ValueError):
        pass
    cgroups.drop_charges(rel)


def v1_pages_charged(memory_dir: Path) -> int:
    """Bytes of pages (page cache, anonymous) charged to a v1 memory cgroup and below.

    From memory.stat, not ``usage - kmem``: that also counts the charges each CPU
    holds in advance for the cgroup (up to 64 pages a CPU), which force_empty drains
    at once only on its own CPU and on the others by queued work; pages are what
    keeps a removed cgroup alive as a dying one."""
    total = 0
    for line in (memory_dir / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in _PAGE_KEYS:
            total += int(value)
    return total


# v1 memory.stat lines that count pages charged to the cgroup and its children.
_PAGE_KEYS = frozenset({"total_cache", "total_rss", "total_rss_huge", "total_shmem"})


def link_legacy_socket(path: Path, legacy: Path) -> None:
    """A sandbox an older version started serves ``legacy`` (its socket inside the
    sandbox's directory): a link to it at ``path``, so every caller keeps the one path
    ``ContainerBackend.agent_socket`` names. The link goes at teardown, the socket
    with the sandbox's directory."""
    if not path.exists() and not path.is_symlink() and legacy.exists():
        path.symlink_to(legacy)


class ContainerBackend(AgentDataPath, Backend):
    kind = BackendKind.CONTAINER
    capabilities = frozenset(
        {
            Capability.SESSIONS,
            Capability.FILES,
            Capability.PAUSE,
            Capability.VERIFY,
            Capability.PROTECTED_PATHS,
            Capability.PACK,
            Capability.FORK,
            Capability.NETWORK_RULES,
            Capability.DISK_LIMIT,
            Capability.QOS,
        }
    )
    # The OCI runtime the platform runs by default (PlatformConfig.runtime).
    DEFAULT_RUNTIME = "crun"

    @classmethod
    def probe(cls) -> str | None:
        """Root, a cgroup file system and the OCI runtime on PATH. (overlayfs and EROFS
        are not probed: the kernel loads their modules on the first mount.)"""
        if os.geteuid() != 0:
            return "needs root (mounts, cgroups, namespaces)"
        if not os.path.ismount("/sys/fs/cgroup"):
            return "no cgroup file system at /sys/fs/cgroup"
        if shutil.which(cls.DEFAULT_RUNTIME) is None:
            return f"no {cls.DEFAULT_RUNTIME} on PATH (apt-get install {cls.DEFAULT_RUNTIME})"
        return None

    @classmethod
    def from_host(cls, host: BackendHost) -> Self:
        """The platform's container backend: runtime state on a tmpfs under the data
        dir, seccomp and the quota-capable sandbox disk as configured."""
        config = host.config
        run = config.data_dir / "run"
        runtime = OCIRuntime(
            runtime=config.runtime,
            state_root=run / config.runtime.rsplit("/", 1)[-1],
            wrapper=host.agent_binary,
            cgroups=host.cgroups,
            empty_file=run / "empty",
            cgroup_parent=f"dsec/{config.edge_id}",
        )
        return cls(
            shared_sys=SharedSys(run, host.cgroups),
            sandboxes_dir=config.sandboxes_dir,
            agent_sockets_dir=config.agent_sockets_dir,
            runtime=runtime,
            layers=host.layers,
            agent_binary=host.agent_binary,
            cgroups=host.cgroups,
            cgroup_parent=f"dsec/{config.edge_id}",
            audit=host.audit,
            seccomp=SeccompGuard(
                socket_path=config.seccomp_socket if config.seccomp_notify else None,
                audit=host.audit,
            )
            if config.seccomp
            else None,
            disk=SandboxDisk(
                config.sandboxes_dir,
                config.sandbox_disk_image,
                size_bytes=config.sandbox_disk_gb * GiB if config.sandbox_disk_gb else None,
                enabled=config.sandbox_disk_gb != 0,
                preallocate=config.sandbox_disk_preallocate,
            ),
        )

    def __init__(
        self,
        *,
        sandboxes_dir: Path,
        runtime: OCIRuntime,
        agent_sockets_dir: Path | None = None,
        layers: LayerMounts,
        agent_binary: Path,
        cgroups: CgroupHost,
        cgroup_parent: str,
        create_concurrency: int = 8,
        prewarm_limit: int = 512 * 1024 * 1024,
        audit: AuditSink | None = None,
        seccomp: SeccompGuard | None = None,
        disk: SandboxDisk | None = None,
        shared_sys: SharedSys | None = None,
    ) -> None:
        # Writable-disk quotas (dsec.resources.disk); None = plain dirs, no limit.
        self.disk = disk or SandboxDisk(
            sandboxes_dir, sandboxes_dir.with_name(sandboxes_dir.name + ".img"), enabled=False
        )
        self.audit: AuditSink = audit or NullAudit()
        # seccomp profile + notify listener (dsec.security.seccomp); None = no filter
        self.seccomp = seccomp
        # One read-only /sys for every sandbox (no sysfs or cgroup tmpfs of their own);
        # None, or one that failed to mount: each sandbox mounts its own as before.
        self.shared_sys = shared_sys
        self._shared_sys_note = "off"
        self.sandboxes_dir = sandboxes_dir
        # Not in the sandboxes' own directories: see agent_socket.
        self.agent_sockets_dir = agent_sockets_dir or sandboxes_dir.with_name(
            sandboxes_dir.name + ".agents"
        )
        self.runtime = runtime
        self.layers = layers
        self.agent_binary = agent_binary
        self.cgroups = cgroups
        self.cgroup_parent = cgroup_parent.strip("/")
        self.host_cpus = os.cpu_count() or 1
        # crun forks are CPU-bound: more in flight than cores only adds queueing. Public:
        # the verifier's containers (dsec.backends.container.verifier) queue here too.
        self.runtime_slots = asyncio.Semaphore(create_concurrency)
        self._reaper: asyncio.Task[None] | None = None
        self.prewarm_limit = prewarm_limit
        self._warm: set[str] = set()
        self._warming: dict[str, asyncio.Future[int]] = {}
        # inotify on protected-path decoys: one fd for the edge (dsec.security.protected)
        self.decoys = protected_paths.DecoyWatcher(self.audit)
        # pid 1's reports of signals sent to it from inside (dsec.security.init_signals)
        self.init_signals = InitSignalWatcher(self.audit)
        # which channel watches each pid 1: the notify fd, else that connection
        self.init_channels = InitChannels(self.init_signals, self.agent_socket)
        self.verifiers = verifier.Verifiers()  # verifies in flight, their cleanups
        # Teardown's blocking work: its own threads at a lower CPU priority, so that it
        # neither takes the cores nor the to_thread workers creates need.
        self.teardown_pool = LowPriorityPool("dsec-teardown", workers=max(4, 2 * self.host_cpus))

    # -- paths (public: the verifier builds its containers beside the sandboxes) -------
    def sandbox_dir(self, sandbox_id: str) -> Path:
        """The host directory of container ``sandbox_id`` (config, upper, work, socket)."""
        return self.sandboxes_dir / sandbox_id

    def agent_socket(self, sandbox_id: str) -> Path:
        """The unix socket pid 1 (the agent) of container ``sandbox_id`` serves on.

        One directory for all of them, not each sandbox's own: a sandbox's directory
        is a btrfs subvolume of its own, whose inode numbers start over, so every
        ``agent.sock`` there had the same inode number. The kernel finds the socket
        behind a path in a table hashed by inode number alone, so all of them shared
        one chain and every connect walked it: 3 us with one sandbox, 60 us with 2,000,
        on every command and file operation (measured, perf: unix_find_other)."""
        return self.agent_sockets_dir / f"{sandbox_id}.sock"

    def _legacy_agent_socket(self, sandbox_id: str) -> Path:
        """Where an older version bound it (inside the sandbox's directory)."""
        return self.sandbox_dir(sandbox_id) / "agent.sock"

    def _adopt_agent_socket(self, sandbox_id: str) -> None:
        link_legacy_socket(self.agent_socket(sandbox_id), self._legacy_agent_socket(sandbox_id))

    def cgroup_of(self, sandbox_id: str) -> str:
        """The cgroup path of container ``sandbox_id``, relative to every hierarchy."""
        return f"/{self.cgroup_parent}/{sandbox_id}"

    async def start(self) -> None:
        await asyncio.to_thread(self.disk.open)  # mounts the quota-capable file system
        await asyncio.to_thread(self.runtime.open)  # its state on a tmpfs
        await asyncio.to_thread(self._open_shared_sys)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.agent_sockets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._reaper = asyncio.create_task(
            keep_running("orphan-reaper", self._reap_loop), name="dsec-orphan-reaper"
        )
        self.decoys.start()
        self.init_signals.start()
        if self.seccomp is not None:
            if self.seccomp.listener is not None:
                self.seccomp.listener.observe(asyncio.get_running_loop(), self.init_channels)
            self.seccomp.start()
        probe = self.agent_socket("x" * 16 + "-" + "0" * 16)
        if len(os.fsencode(probe)) > MAX_SOCKET_PATH:
            raise BackendError(
                f"data directory path too long for unix sockets ({probe}); use a shorter --data-dir"
            )

    def _open_shared_sys(self) -> None:
        if self.shared_sys is None:
            return
        try:
            self.shared_sys.open()
        except OSError as exc:
            # Sandboxes still work, each with a sysfs of its own (costlier): say so.
            self._shared_sys_note = f"off ({exc})"
            log.warning("no shared /sys, every sandbox mounts its own: %s", exc)
            return
        self._shared_sys_note = "on"

    def sys_mounts(self, sandbox_id: str) -> list[dict[str, Any]] | None:
        """What container ``sandbox_id`` mounts at /sys: the platform's shared read-only
        tree (SharedSys), or None for a sysfs of its own. Public: the verifier's
        containers mount the same."""
        if self.shared_sys is None or not self.shared_sys.active:
            return None
        return self.shared_sys.sandbox_mounts(self.cgroup_of(sandbox_id))

    async def _prewarm(self, digest: str, mount_point: Path) -> None:
        """Read a small layer once from the edge, so its page cache is charged to the
        edge's long-lived cgroup, not to whichever sandbox touches a file first (that
        charge would outlive the sandbox and pin its memory cgroup)."""
        if digest in self._warm:
            return
        task = self._warming.get(digest)
        if task is None:
            task = asyncio.ensure_future(
                asyncio.to_thread(prewarm_tree, mount_point, self.prewarm_limit)
            )
            self._warming[digest] = task
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._warming.pop(digest, None)
                self._warm.add(digest)

    async def _reap_loop(self) -> None:
        names = frozenset({self.runtime.name, Path(AGENT_PATH_IN_SANDBOX).name})
        while True:
            spawn.reap_orphans(names)
            await asyncio.sleep(0.5)

    def details(self) -> Mapping[str, str]:
        """QoS support of this host: core scheduling for latency sandboxes where the
        kernel has it (detected once; not faked where it does not)."""
        return {**qos.health_detail(), "shared_sys": self._shared_sys_note}

    async def close(self) -> None:
        """Remove this edge's parent cgroup if no sandbox is left in it."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await self.verifiers.settle_all()
        self.decoys.close()
        self.init_signals.close()
        if self.seccomp is not None:
            self.seccomp.close()
        spawn.reap_orphans(frozenset({self.runtime.name, Path(AGENT_PATH_IN_SANDBOX).name}))
        if not self.cgroups.children(f"/{self.cgroup_parent}"):
            await asyncio.to_thread(
                self.cgroups.kill_and_remove, f"/{self.cgroup_parent}", timeout=1
            )
            # The shared top (e.g. "dsec") too, when no other edge uses it.
            top = self.cgroup_parent.split("/")[0]
            if top != self.cgroup_parent:
                self.cgroups.remove_if_empty(f"/{top}")
        await asyncio.to_thread(self.disk.close)  # unmounts only when no sandbox is left
        await asyncio.to_thread(self.runtime.close)  # likewise
        if self.shared_sys is not None:  # running sandboxes keep their own copy
            await asyncio.to_thread(self.shared_sys.close)
        await asyncio.to_thread(self.teardown_pool.close)

    # -- lifecycle ----------------------------------------------------------------------
    async def start_agent_container(
        self,
        cid: str,
        root: Path,
        config: dict[str, Any],
        *,
        overlay: tuple[Path, str],
        dev_tmpfs: Path | None,
        backlog: int,
    ) -> int:
        """Start container ``cid`` from ``config`` in bundle ``root`` with our agent as
        its init, serving the socket ``agent_socket(cid)`` (bound here, ``backlog``
        deep, handed to the agent); returns the init's pid. The one way a container of
        this backend starts: a sandbox's and a verifier's (dsec.backends.container.
        verifier) alike, under the same create-concurrency slots. On failure leaves the
        bundle and socket path for the caller's teardown, like every create step."""
        (root / "config.json").write_text(json.dumps(config))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.agent_socket(cid)))
            listener.listen(backlog)
            async with self.runtime_slots:
                await self.runtime.run_detached(
                    cid,
                    root,
                    root / "init.pid",
                    agent_fd=listener.fileno(),
                    overlay=overlay,
                    dev_tmpfs=dev_tmpfs,
                )
        finally:
            # The agent holds its own copy now; ours would only cost an fd per sandbox.
            listener.close()
        return int((root / "init.pid").read_text().strip())

    async def create(self, inp: CreateInput) -> ContainerFacts:
        sid, spec = inp.id, container_spec(inp)
        net = dict(inp.net) if inp.net is not None else None  # dsec.net's (egress rules)
        root = self.sandbox_dir(sid)
        rootfs, upper, work = root / "rootfs", root / "upper", root / "work"
        dev = self.runtime.dev_tmpfs(root)  # /dev and /dev/shm: one tmpfs (oci_spec)
        facts = ContainerFacts(dir=root, layers=list(inp.image.layers))
        try:
            # The sandbox's directory is its own quota group: upper, work and all.
            facts.disk_qgroup = self.disk.create_dir(
                root, limit_bytes=self.disk.limit_bytes(spec.disk_limit_mb)
            )
            for d in (rootfs, upper, work, *([dev] if dev else [])):
                d.mkdir(parents=True, exist_ok=False)
            # Fetch what this host lacks: only chunk indexes when lazy, whole layers when eager.
            await self.layers.prepare(inp.image.layers, spec.image_loading)
            lowers = []
            for digest in reversed(inp.image.layers):  # overlay wants the top layer first
                lowers.append(str(self.layers.acquire(digest, holder=sid)))
                facts.layers_held.append(digest)
                if not self.layers.is_lazy(digest):  # lazy layers are read on demand only
                    await self._prewarm(digest, Path(lowers[-1]))
            overlay = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},volatile"
            prepared = await self._prepare_protected(inp, root, facts) if spec.protected else []
            config = build_config(
                sandbox_id=sid,
                spec=spec,
                rootfs=rootfs,
                agent_binary=self.agent_binary,
                cgroup_path=self.cgroup_of(sid),
                host_cpus=self.host_cpus,
                extra_mounts=protected_paths.decoy_mounts(prepared) + net_mounts(net),
                seccomp=self.seccomp_profile(sid),
                netns_path=net["netns"] if net else None,
                cpu_idle=self.cgroups.has_cpu_idle,
                sys_mounts=self.sys_mounts(sid),
                dev_tmpfs=dev,
            )
            facts.pid = await self.start_agent_container(
                sid, root, config, overlay=(rootfs, overlay), dev_tmpfs=dev, backlog=512
            )
            # Before any command runs: what the agent forks from now on inherits it.
            floor = oom.floor_enforced()  # crun set the bias; a host write sets its floor
            if floor or qos.acts_on(spec.qos):  # read the cgroup only when something acts
                started = self.cgroups.pids(self.cgroup_of(sid)) or {facts.pid}
                if qos.acts_on(spec.qos):
                    qos.apply(spec.qos, started)
                for pid in started if floor else ():
                    oom.set_oom_score_adj(pid, oom.oom_score_adj(spec.qos))
            facts.seccomp = self._seccomp_attached(sid)
            self.decoys.watch(sid, prepared)
            self.init_channels.started(sid, notify=facts.seccomp == "notify")
            await self.check_init_user(sid, spec.init_user)
        except BaseException:
            # Nothing of it may outlive a create that did not return: the edge gets no
            # facts to tear down from (an agent's refusal of the user included). Not
            # even when the create is cancelled twice (its timeout, then its client).
            with contextlib.suppress(Exception):
                await undo_to_the_end(self.teardown(sid, facts))
            raise
        return facts

    async def _prepare_protected(
        self, inp: CreateInput, root: Path, facts: ContainerFacts
    ) -> list[protected_paths.Prepared]:
        """Hold each protected layer for the sandbox's life, write inline files, build
        the decoys (see dsec.security.protected)."""
        spec = container_spec(inp)
        if len(inp.protected_layers) != len(spec.protected):
            raise BackendError("protected layers were not resolved before create")
        layers: list[tuple[str, Path] | None] = []
        for digest in inp.protected_layers:  # resolved by the edge (None: inline files)
            if digest is None:
                layers.append(None)
                continue
            await self.layers.prepare([digest], spec.image_loading)
            layers.append((digest, self.layers.acquire(digest, holder=inp.id)))
            facts.layers_held.append(digest)
        # Inline contents come from the edge beside the (redacted) spec.
        contents = [dict(f) for f in inp.protected_files] or [dict(m.files) for m in spec.protected]
        mounts = [
            m.model_copy(update={"files": files}) if m.files else m
            for m, files in zip(spec.protected, contents, strict=True)
        ]
        prepared = await asyncio.to_thread(protected_paths.prepare, root, mounts, layers)
        facts.protected = prepared
        return prepared

    async def verify(self, rec: SandboxRecord, req: VerifyRequest) -> VerifyResult:
        """Run the grader in a pristine verifier that sees snapshots of the graded
        paths and the protected paths (dsec.backends.container.verifier)."""
        return await verifier.run_verify(self, rec, req)

    def supervised(self) -> list[tuple[str, Callable[[], str | None], Callable[[], None]]]:
        listener = self.seccomp.listener if self.seccomp is not None else None
        if listener is None:
            return []
        return [("seccomp-listener", listener.healthy, listener.restart)]

    def loops(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        # The host-space guard of a sparse sandbox disk image (dsec.resources.diskguard).
        guard = self.disk.guard
        return [] if guard is None else [("sandbox-disk-guard", guard.run)]

    def disk_pressure(self) -> str | None:
        guard = self.disk.guard
        return None if guard is None else guard.reason

    def seccomp_profile(self, sid: str, *, report_as: str | None = None) -> dict[str, Any] | None:
        """The ``linux.seccomp`` of container ``sid``; violations are recorded under
        ``report_as`` (e.g. the sandbox a verifier container grades), default ``sid``."""
        return self.seccomp.profile(report_as or sid) if self.seccomp is not None else None

    def _seccomp_attached(self, sid: str) -> str | None:
        """Which filter container ``sid`` runs under (None: none), checked."""
        if self.seccomp is None:
            return None
        self.seccomp.check_attached(sid)
        return "notify" if self.seccomp.notify else "errno"

    def facts(self, rec: SandboxRecord) -> ContainerFacts:
        """The record's facts, typed (parsed once if they were stored ones: the
        record's facts are this backend's to keep)."""
        facts = rec.facts
        if not isinstance(facts, ContainerFacts):
            facts = ContainerFacts.of(facts)
            rec.facts = facts
        return facts

    def watch_init_channel(self, rec: SandboxRecord, on_closed: Callable[[str], None]) -> bool:
        """pid 1's notify fd hangs up, or its signal-report connection ends, with pid 1
        (dsec.backends.container.initwatch)."""
        return self.init_channels.watch_init(rec.id, on_closed)

    def load_facts(self, data: Mapping[str, Any]) -> ContainerFacts:
        return ContainerFacts.from_json(data)

    async def destroy(self, rec: SandboxRecord) -> None:
        await self.verifiers.settle(rec.id)
        await self.teardown(rec.id, self.facts(rec))

    async def teardown(self, sid: str, facts: ContainerFacts) -> None:
        """Remove every kernel object of container ``sid`` (a sandbox or a verifier),
        releasing the layers ``facts`` holds; idempotent, works on half-made ones. The
        layers are released also when a step fails or the teardown is cancelled
        midway: what is left is the next teardown's or the next start's, but no layer
        stays counted as used."""
        try:
            await self._remove_objects(sid, facts)
        finally:
            self.layers.release_held(facts.layers_held, holder=sid)

    async def _remove_objects(self, sid: str, facts: ContainerFacts) -> None:
        """Everything of ``teardown`` but the layers (BackendError: what is left)."""
        self.decoys.unwatch(sid)  # before anything of ours opens the decoys
        self.init_channels.forget(sid)
        if self.seccomp is not None:
            self.seccomp.forget(sid)
        root = self.sandbox_dir(sid)
        errors: list[str] = []
        cgroup = self.cgroup_of(sid)
        # Empty the cgroup first and reclaim what it was charged for, so that the
        # deleted cgroup does not linger as a dying memcg (see CgroupHost.drop_charges).
        # A sandbox whose cgroup is empty is dead: its cgroups and runtime state go
        # without the runtime (one fork+exec less); else `delete --force` kills it.
        low = self.teardown_pool
        forgotten = await low.run(self._empty_and_forget, sid, cgroup)
        if not forgotten:
            try:
                async with self.runtime_slots:
                    await self.runtime.delete(sid)
            except BackendError as exc:
                errors.append(str(exc))
            # Belt and braces: a crashed create may have left a cgroup crun does not know.
            await low.run(self.cgroups.kill_and_remove, self.cgroup_of(sid))
        await self._reap(facts.pid)
        # The overlay lives in the sandbox's own mount namespace and is gone with its
        # last process; a host mount here can only be a leftover of an older version.
        rootfs = root / "rootfs"
        leftover_mount = _host_mounted(rootfs)
        if leftover_mount:
            try:
                linux.umount(rootfs, detach=True)
            except OSError as exc:
                errors.append(str(exc))
        # A detached unmount that did not take: keep the directory.
        still_mounted = leftover_mount and linux.is_mounted(rootfs)
        if root.exists() and not still_mounted:
            try:  # a quota subvolume goes in one call, its quota group with it
                await low.run(self.disk.remove_dir, root)
            except OSError as exc:
                errors.append(f"remove {root}: {exc}")
        if root.exists() and not still_mounted:
            await low.run(shutil.rmtree, root, True)
        try:
            self.agent_socket(sid).unlink(missing_ok=True)
        except OSError as exc:
            errors.append(f"remove {self.agent_socket(sid)}: {exc}")
        if errors:
            raise BackendError(f"cleanup of {sid} incomplete: {'; '.join(errors)}")

    def _empty_and_forget(self, sid: str, cgroup: str) -> bool:
        """Kill what is left in the cgroup, reclaim its pages, remove it and the
        runtime's state (one thread hop). False: something is left for the runtime."""
        if not self._kill_cgroup(cgroup):
            return False
        drop_page_charges(self.cgroups, cgroup)
        dirs = self.cgroups.dirs(cgroup)
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # a nested cgroup, or a process that got in: the slow path
                return False
        return self.runtime.forget(sid)

    def _kill_cgroup(self, cgroup: str, timeout: float = 5.0) -> bool:
        """SIGKILL everything in the cgroup and wait until it is empty.

        CgroupHost.kill_all re-reads every hierarchy (8 here) on each 1 ms poll; that
        was a quarter of the platform's Python time per teardown. Here: kill what the
        first hierarchy lists, poll that list until it is empty, then check every
        hierarchy (and nested cgroups) once (anything found: kill_all's loop)."""
        procs = self.cgroups.sandbox_dirs(cgroup)[0] / "cgroup.procs"
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not procs.read_text().split():
                    break
            except OSError:
                break
            time.sleep(0.001)
        return self.cgroups.kill_all(cgroup, timeout=max(0.1, deadline - time.monotonic()))

    @staticmethod
    async def _reap(pid: object, timeout: float = 2.0) -> None:
        """Collect the dead init when we are its subreaper, so it leaves no zombie.
        (After an edge restart the init is not our child: ChildProcessError, nothing to do.)"""
        if not isinstance(pid, int):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
            except ChildProcessError:
                return
            if done or loop.time() > deadline:
                return
            await asyncio.sleep(0.005)

    async def still_running(self, rec: SandboxRecord) -> bool:
        """Whether its init (the agent) runs, by the runtime's state, without a ping. A
        frozen one (a verify or pack of this process holds it) still runs: crun calls
        that "paused", and it is not pinged, since it cannot answer until thawed."""
        state = await self.runtime.state(rec.id)
        return state is not None and state.get("status") in ("running", "created", "paused")

    async def is_alive(self, rec: SandboxRecord) -> bool:
        await verifier.recover(self, rec.id)  # an edge killed mid-verify left it frozen
        state = await self.runtime.state(rec.id)
        if state is None or state.get("status") not in ("running", "created"):
            # Said in the log: a sandbox declared lost is destroyed, and why is the
            # first thing an operator (or a failed test's log tail) needs.
            status = "no runtime state" if state is None else f"status {state.get('status')!r}"
            log.warning("sandbox %s: not alive (%s)", rec.id, status)
            return False
        # Declaring a live sandbox lost destroys it: on a loaded host (a restart is
        # often a busy moment, and a thawed agent must first be scheduled) give the
        # agent more than one chance before believing it dead.
        for timeout in (2.0, 4.0, 8.0):
            try:
                await self.agent(rec).ping(timeout=timeout)
            except Exception as exc:
                log.warning("sandbox %s: agent did not answer a ping (%s)", rec.id, exc)
                continue
            return True
        return False

    async def adopt(self, rec: SandboxRecord) -> None:
        # A crash in the middle of an idle reclaim under pressure left the raised
        # swappiness on a running sandbox: its parent's (0) again (dsec.edge.idle).
        freezer.settle_swappiness(self.cgroups, self.cgroup_of(rec.id))
        await self.layers.prepare(rec.image.layers, container_spec(rec).image_loading)
        facts = self.facts(rec)
        held = []
        prepared = facts.protected
        if any(p.digest for p in prepared):
            await self.layers.prepare(
                [p.digest for p in prepared if p.digest], container_spec(rec).image_loading
            )
        for digest in [*rec.image.layers, *(p.digest for p in prepared if p.digest)]:
            self.layers.acquire(digest, holder=rec.id)
            held.append(digest)
        facts.layers_held = held  # what this process holds (the stored list was the last one's)
        if (
            facts.disk_qgroup is not None
        ):  # the disk guard tracks it again (dsec.resources.diskguard)
            self.disk.adopt_dir(
                self.sandbox_dir(rec.id),
                facts.disk_qgroup,
                limit_bytes=self.disk.limit_bytes(rec.spec.disk_limit_mb),
            )
        self._adopt_agent_socket(rec.id)
        self.decoys.watch(rec.id, prepared)
        self.init_channels.adopted(rec.id)  # and what pid 1 kept meanwhile
        if facts.seccomp == "notify":
            # Its notify fd died with the old edge: dangerous calls still fail (ENOSYS)
            # but are no longer recorded; say so, so a trainer can tell.
            self.audit.record(rec.id, AuditKind.LIFECYCLE, "seccomp_unmonitored")

    async def sweep(self, known_ids: set[str]) -> list[str]:
        removed: list[str] = []
        leftovers = set(self.runtime.list_ids())
        if self.sandboxes_dir.is_dir():
            leftovers.update(e.name for e in os.scandir(self.sandboxes_dir) if e.is_dir())
        if self.agent_sockets_dir.is_dir():
            leftovers.update(
                e.name.removesuffix(".sock")
                for e in os.scandir(self.agent_sockets_dir)
                if e.name.endswith(".sock")
            )
        leftovers.update(self.cgroups.children(f"/{self.cgroup_parent}"))
        for sid in sorted(leftovers - known_ids):
            try:
                # Layers of unknown sandboxes were never counted in this process.
                await self.teardown(sid, ContainerFacts())
                removed.append(sid)
            except BackendError as exc:
                log.warning("sweep of %s incomplete: %s", sid, exc)
        return removed

    def writable_dir(self, rec: SandboxRecord) -> Path | None:
        return self.facts(rec).upper

    # -- pause, reclaim, pack (dsec.backends.container.freezer) -------------------------
    def pause(self, rec: SandboxRecord) -> None:
        freezer.pause(self.cgroups, self.cgroup_of(rec.id))

    async def reclaim(self, rec: SandboxRecord, *, swap: bool) -> ReclaimFigures:
        return await freezer.reclaim(self.cgroups, self.cgroup_of(rec.id), swap=swap)

    async def reclaim_idle(self, rec: SandboxRecord, *, anon: bool) -> ReclaimFigures:
        return await freezer.reclaim_idle(self.cgroups, self.cgroup_of(rec.id), anon=anon)

    async def prefetch(
        self, rec: SandboxRecord, *, swapped: tuple[int, int | None] = (0, None)
    ) -> int:
        return await freezer.prefetch(self.cgroups, self.cgroup_of(rec.id), swapped=swapped)

    def resume(self, rec: SandboxRecord) -> None:
        freezer.resume(self.cgroups, self.cgroup_of(rec.id))

    async def adopt_paused(self, rec: SandboxRecord) -> bool:
        state = await self.runtime.state(rec.id)
        if state is None or state.get("status") not in ("paused", "running", "created"):
            return False
        if not freezer.keep_paused(self.cgroups, self.cgroup_of(rec.id)):
            return False
        await self.adopt(rec)
        return True

    async def pack_writable(
        self, rec: SandboxRecord, out: Path, *, compression: str | None, paused: bool
    ) -> PackedWritable:
        upper = self.writable_dir(rec)
        if upper is None or not upper.is_dir():
            raise Unsupported(f"sandbox {rec.id} has no writable layer to pack")
        files, excluded = await freezer.pack(
            rec,
            self.cgroups,
            self.cgroup_of(rec.id),
            upper,
            out,
            compression=compression,
            frozen_already=paused,
        )
        return PackedWritable(files=files, excluded=excluded)

    def check_limits(self, spec: Any) -> None:
        if (
            self.disk.enabled
            and spec.disk_limit_mb is not None
            and spec.disk_limit_mb * MiB > self.disk.capacity
        ):
            raise LimitExceeded(
                f"disk_limit_mb={spec.disk_limit_mb} exceeds this host's sandbox disk of "
                f"{self.disk.capacity // MiB} MiB",
                host_disk_mb=self.disk.capacity // MiB,
            )

    def limit_cgroup(self, rec: SandboxRecord) -> str | None:
        return self.cgroup_of(rec.id)

    def limit_counters(self, rec: SandboxRecord) -> LimitReading:
        oom, pids = read_cgroup_counters(self.cgroups, self.cgroup_of(rec.id))
        qgroup = self.facts(rec).disk_qgroup
        disk = self.disk.usage(qgroup) if qgroup is not None else None
        return LimitReading(oom_kills=oom, pids_refused=pids, disk=disk)

    async def stats(self, rec: SandboxRecord) -> dict[str, Any]:
        rel = self.cgroup_of(rec.id)
        return {
            "memory_bytes": self.cgroups.memory_usage(rel),
            "cpu_seconds": self.cgroups.cpu_seconds(rel),
        }
