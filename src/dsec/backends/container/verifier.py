"""The verifier: a grader that runs in a world the agent never wrote to.

A reward is only worth something if nothing the agent did can decide it except the work
it was asked to do. So a verify step trusts three things and nothing else: the caller's
grader command, the platform-owned read-only layers (the pristine image layers the
sandbox started from, and the protected grader/answer sources), and its own code. The
agent's work reaches it only as *data*:

1. The agent is frozen (cgroup freezer, ~0.2 ms). In ``fresh`` mode (the default) its
   processes are then killed: it is stopped before the grader starts, so nothing the
   grader does (cache residency of shared files, timing) can ever flow back to it. In
   ``isolated`` mode it stays frozen for the whole step and is thawed after.
2. In a thread of its own, in a private mount namespace (no host mount, none left
   behind by a crash), the edge mounts the agent's merged view read-only and copies each
   graded path out of it (dsec.security.graded: nothing followed, links that leave the
   graded tree refused and reported, own inodes, bounded).
3. The verifier is a separate crun container: own pid, mount, ipc, uts, network and
   cgroup namespaces (no shared /tmp, /dev/shm, processes or sockets with the agent).
   Its root is an overlay of the *pristine* layers only with a private upper, so the
   agent's interpreter, libraries, loader configuration, start-up files and PATH shadows
   are not there. The snapshots are bind-mounted read-only at their graded paths, the
   protected sources read-only at theirs.
4. The grader runs as root (by default) with a fixed environment, from ``/``. When it
   must run the agent's code it uses ``$DSEC_UNTRUSTED`` (dsec-untrusted.c): an
   unprivileged user that Landlock keeps out of the protected paths and the result
   directory. The verdict is the grader's exit status, decided here; files the grader
   writes to ``$DSEC_RESULT_DIR`` come back as ``results`` (only root can write there).

pid 1 of the verifier is the same agent as in every sandbox, so user names, timeouts and
output caps behave exactly as for ``exec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec import linux
from dsec.agent.build import untrusted_binary
from dsec.api.events import EventKind
from dsec.api.verify import GradedRefusal, VerifyRequest, VerifyResult
from dsec.backends.agentpath import image_env
from dsec.backends.container.facts import ContainerFacts
from dsec.backends.container.oci_spec import build_config
from dsec.errors import BackendError, Conflict
from dsec.security import graded as graded_trees
from dsec.security import protected
from dsec.security.graded_paths import resolve_graded
from dsec.sessions.agent_client import AgentClient

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.backends.container.backend import ContainerBackend

log = logging.getLogger(__name__)

# A verify without a timeout would keep the agent frozen forever.
DEFAULT_VERIFY_TIMEOUT = 600.0
SUFFIX = ".v"
UNTRUSTED_IN_VERIFIER = "/.dsec/untrusted"
VERIFY_DIR_IN_VERIFIER = "/.dsec/verify"
RESULT_DIR_IN_VERIFIER = "/.dsec/result"
MAX_RESULT_FILES = 64
MAX_RESULT_BYTES = 64 * 1024
# The grader's environment: nothing inherited from the agent's sandbox, no loader or
# interpreter hooks. Defaults the pristine image's own environment may change ...
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
HOME_IN_VERIFIER = "/.dsec/home"
# ... and what it may not (the request's own env, the caller's, comes last). HOME is a
# fresh directory: /root and /home are usually graded, and tools read their
# configuration from HOME (~/.gitconfig aliases and pagers, ~/.npmrc, pip.conf, ...).
FIXED_ENV = {
    "HOME": HOME_IN_VERIFIER,
    "PYTHONNOUSERSITE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    # A planted *.dist-info on the grader's module path must not load a pytest plug-in.
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    "DSEC_UNTRUSTED": UNTRUSTED_IN_VERIFIER,
    "DSEC_RESULT_DIR": RESULT_DIR_IN_VERIFIER,
}
# Never taken from the image's environment: they would run code before the grader's.
HOOK_VARIABLES = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "PYTHONSTARTUP",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PERL5OPT",
        "PERL5LIB",
        "RUBYOPT",
        "NODE_OPTIONS",
        "BASH_ENV",
        "ENV",
        "PYTEST_ADDOPTS",
        "PYTEST_PLUGINS",
    }
)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
CLONE_NEWNS = 0x00020000


def verifier_id(sandbox_id: str) -> str:
    """Never a sandbox id (those end in 16 hex digits), so sweeps treat a leftover as
    unknown and remove it."""
    return sandbox_id + SUFFIX


class Verifiers:
    """Which sandboxes have a verify in flight, and the background cleanups of
    finished verifiers (crun delete, cgroup removal, rmtree: ~12 ms nobody should wait
    for once every verifier process is dead)."""

    def __init__(self) -> None:
        self.busy: set[str] = set()
        self.cleanups: dict[str, asyncio.Task[None]] = {}

    async def settle(self, sandbox_id: str) -> None:
        """Wait for the cleanup of this sandbox's last verifier (before the next one
        reuses its name, and before the sandbox itself is torn down)."""
        task = self.cleanups.get(sandbox_id)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
            if self.cleanups.get(sandbox_id) is task:
                del self.cleanups[sandbox_id]

    async def settle_all(self) -> None:
        for sandbox_id in list(self.cleanups):
            await self.settle(sandbox_id)


async def _cleanup(backend: ContainerBackend, vid: str, held: ContainerFacts) -> None:
    try:
        await backend.teardown(vid, held)
    except Exception as exc:  # the edge's sweep removes what is left at its next start
        log.warning("cleanup of verifier %s incomplete: %s", vid, exc)


async def run_verify(
    backend: ContainerBackend, rec: SandboxRecord, req: VerifyRequest
) -> VerifyResult:
    """Freeze (and in fresh mode stop) the agent, snapshot its graded paths, run the
    grader in a pristine verifier, kill it, thaw; the rest of the teardown runs in the
    background (see Verifiers)."""
    graded = resolve_graded(rec.spec, req) if req.graded is None else list(req.graded)
    state = backend.verifiers
    if rec.id in state.busy:
        raise Conflict(f"sandbox {rec.id} is already being verified; wait for that to end")
    state.busy.add(rec.id)
    try:
        await state.settle(rec.id)
        return await _verify(backend, rec, req, graded)
    finally:
        state.busy.discard(rec.id)


def _stop_frozen(backend: ContainerBackend, rel: str) -> None:
    """Kill every process of a frozen cgroup without letting any run again: SIGKILL is
    queued while frozen, so on thaw each dies before returning to user space."""
    for d in backend.cgroups.sandbox_dirs(rel)[:1]:
        with contextlib.suppress(OSError, ValueError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
    protected.thaw(backend.cgroups, rel)
    if not backend.cgroups.kill_all(rel, timeout=5.0):
        raise BackendError(f"the processes of {rel} did not die within 5s")


def _snapshot_in_private_ns(
    root: Path, upper: Path, pristine: list[str], graded: list[str]
) -> graded_trees.Snapshot:
    """Mount the agent's merged view and the pristine image read-only and copy what the
    agent changed under the graded paths, in a thread with a mount namespace of its own:
    the mounts are never on the host, and they vanish with the thread (also if the edge
    dies meanwhile)."""
    out: list[graded_trees.Snapshot] = []
    errors: list[BaseException] = []
    flags = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV

    def work() -> None:
        try:
            if _libc.unshare(CLONE_NEWNS) != 0:
                err = ctypes.get_errno()
                raise BackendError(f"unshare(CLONE_NEWNS): {os.strerror(err)}", errno=err)
            linux.mount("none", "/", "none", linux.MS_REC | linux.MS_PRIVATE)
            view = root / "view"
            view.mkdir(mode=0o700, exist_ok=True)
            linux.mount("overlay", view, "overlay", flags, f"lowerdir={upper}:{':'.join(pristine)}")
            image: Path | None = Path(pristine[0]) if len(pristine) == 1 else None
            if len(pristine) > 1:
                image = root / "pristine"
                image.mkdir(mode=0o700, exist_ok=True)
                linux.mount("overlay", image, "overlay", flags, f"lowerdir={':'.join(pristine)}")
            out.append(graded_trees.snapshot(view, upper, image, graded, root / "graded"))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=work, name="dsec-verify-snapshot", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _refusal_event(
    backend: ContainerBackend, rec: SandboxRecord, snap: graded_trees.Snapshot
) -> None:
    if not snap.refused_count:
        return
    backend.audit.event(
        rec.id,
        EventKind.GRADED_LINK_ESCAPE,
        count=snap.refused_count,
        refused=[f"{path}: {why}" for path, why in snap.refused[:20]],
    )


async def _verify(
    backend: ContainerBackend, rec: SandboxRecord, req: VerifyRequest, graded: list[str]
) -> VerifyResult:
    vid = verifier_id(rec.id)
    root = backend.sandbox_dir(vid)
    agent_dir = backend.sandbox_dir(rec.id)
    prepared = backend.facts(rec).protected
    held = ContainerFacts()  # the verifier container's: the pristine layers it holds
    rel = backend.cgroup_of(rec.id)
    await asyncio.to_thread(protected.freeze, backend.cgroups, rel)
    dead = False
    started = False
    try:
        try:
            if req.mode == "fresh":
                await asyncio.to_thread(_stop_frozen, backend, rel)
            await asyncio.to_thread(
                backend.disk.create_dir,
                root,
                limit_bytes=backend.disk.limit_bytes(rec.spec.disk_limit_mb),
            )
            started = True
            pristine = []
            for digest in reversed(rec.image.layers):  # overlay wants the top layer first
                pristine.append(str(backend.layers.acquire(digest, holder=vid)))
                held.layers_held.append(digest)
            check_overlay_paths([str(root), *pristine])
            try:
                snap = await asyncio.to_thread(
                    _snapshot_in_private_ns, root, agent_dir / "upper", pristine, graded
                )
            except graded_trees.SnapshotTooLarge as exc:
                backend.audit.event(
                    rec.id, EventKind.SCAN_INCOMPLETE, what="graded snapshot", reason=str(exc)
                )
                return not_run(req, graded, f"the graded tree cannot be snapshotted: {exc}")
            _refusal_event(backend, rec, snap)
            await _start(backend, rec, vid, root, pristine, prepared, snap)
            res = await AgentClient(backend.agent_socket(vid)).exec(
                ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else req.command,
                env=grader_env(rec, req),
                cwd=req.workdir or "/",
                user=req.user or "root",
                timeout=req.timeout or DEFAULT_VERIFY_TIMEOUT,
                max_output=req.max_output_bytes,
                stdin=req.stdin.encode() if req.stdin is not None else None,
            )
        finally:
            # Once every verifier process is dead its mounts have no reader left, and
            # an isolated agent may change its files again.
            if started:
                dead = await asyncio.shield(
                    asyncio.to_thread(backend.cgroups.kill_all, backend.cgroup_of(vid), timeout=5.0)
                )
                if not dead:
                    await asyncio.shield(backend.teardown(vid, held))
        results = await asyncio.to_thread(read_results, root / "result")
    finally:
        try:
            await asyncio.shield(asyncio.to_thread(protected.thaw, backend.cgroups, rel))
        finally:
            if dead:
                backend.verifiers.cleanups[rec.id] = asyncio.create_task(
                    _cleanup(backend, vid, held), name=f"dsec-verifier-cleanup-{vid}"
                )
    out = res.as_exec_result()
    return VerifyResult(
        **out.model_dump(),
        passed=out.exit_code == 0 and not out.timed_out,
        mode=req.mode,
        graded=sorted(snap.copies),
        refused=[GradedRefusal(path=p, reason=why) for p, why in snap.refused],
        results=results,
    )


def not_run(req: VerifyRequest, graded: list[str], why: str) -> VerifyResult:
    """The answer of a step whose grader did not run: failed, with why (fail closed)."""
    return VerifyResult(
        exit_code=-1,
        stdout="",
        stderr=why,
        duration=0.0,
        passed=False,
        mode=req.mode,
        graded=graded,
        error=why,
    )


def grader_env(rec: SandboxRecord, req: VerifyRequest) -> dict[str, str]:
    """Defaults, the pristine image's variables (minus code-loading hooks), the fixed
    ones, then the caller's own for this step; never the agent's or the sandbox spec's
    (the agent may have had a say in neither, but the step must not depend on it)."""
    env = dict(BASE_ENV)
    env.update({k: v for k, v in image_env(rec.image.config).items() if k not in HOOK_VARIABLES})
    env.update(FIXED_ENV)
    env.update(req.env)
    return env


def read_results(result_dir: Path) -> dict[str, str]:
    """The regular files the grader left in its result directory (bounded; links and
    anything else ignored)."""
    out: dict[str, str] = {}
    try:
        dir_fd = os.open(result_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return out
    try:
        for name in sorted(os.listdir(dir_fd))[:MAX_RESULT_FILES]:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                out[name] = os.read(fd, MAX_RESULT_BYTES).decode(errors="replace")
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return out


async def recover(backend: ContainerBackend, sandbox_id: str) -> None:
    """After an edge crash during a verify: remove the verifier, then thaw the agent
    (in that order: no reader may see the agent's upper change). A few stat calls when
    there is nothing to do. Never touches a verify this process is running."""
    if sandbox_id in backend.verifiers.busy or sandbox_id in backend.verifiers.cleanups:
        return
    vid = verifier_id(sandbox_id)
    parent = backend.cgroup_of(vid).rpartition("/")[0]
    if (
        backend.sandbox_dir(vid).exists()
        or vid in backend.runtime.list_ids()
        or vid in backend.cgroups.children(parent)
    ):
        await backend.teardown(vid, ContainerFacts())
    rel = backend.cgroup_of(sandbox_id)
    if await asyncio.to_thread(protected.is_frozen, backend.cgroups, rel):
        await asyncio.to_thread(protected.thaw, backend.cgroups, rel)


def _bind(source: Path | str, dest: str, *, writable: bool = False) -> dict[str, Any]:
    return {
        "destination": dest,
        "type": "bind",
        "source": str(source),
        "options": ["bind", "rw" if writable else "ro", "nosuid", "nodev"],
    }


def _graded_mount(path: str, g: graded_trees.GradedCopy, rootfs: Path) -> dict[str, Any]:
    """The agent's changes at ``path``, read-only: over the pristine image's own content
    there (an overlay whose lower is the verifier's pristine root at that path, mounted
    before this), or on their own."""
    if not g.over_pristine:
        return _bind(g.copy, path)
    return {
        "destination": path,
        "type": "overlay",
        "source": "overlay",
        "options": ["ro", "nosuid", "nodev", f"lowerdir={g.copy}:{rootfs}{path}"],
    }


def check_overlay_paths(paths: list[str]) -> None:
    """overlayfs splits its options at ',' and ':' (and unescapes '\\'): host paths that
    hold them would change the mount."""
    for p in paths:
        if any(c in p for c in ",:\\") or any(c.isspace() for c in p):
            raise BackendError(
                f"path {p!r} cannot be used in an overlay mount; use a plainer --data-dir"
            )


def _verifier_dirs(root: Path, prepared: list[protected.Prepared]) -> None:
    """The verifier's own directories: its root overlay's upper and work, the list of
    paths dsec-untrusted hides, and the result directory only root can write."""
    for d in ("rootfs", "upper", "work"):
        (root / d).mkdir(mode=0o755)
    (root / "verify").mkdir(mode=0o755)
    hidden = "".join(p.path + "\n" for p in prepared)
    (root / "verify" / "hidden").write_text(hidden)
    (root / "result").mkdir(mode=0o700)
    (root / "home").mkdir(mode=0o700)


async def _start(
    backend: ContainerBackend,
    rec: SandboxRecord,
    vid: str,
    root: Path,
    pristine: list[str],
    prepared: list[protected.Prepared],
    snap: graded_trees.Snapshot,
) -> None:
    sock = backend.agent_socket(vid)
    if len(os.fsencode(sock)) > 107:
        raise BackendError(f"verifier socket path too long ({sock}); use a shorter --data-dir")
    await asyncio.to_thread(_verifier_dirs, root, prepared)
    rootfs, upper, work = root / "rootfs", root / "upper", root / "work"
    dev = backend.runtime.dev_tmpfs(root)  # /dev and /dev/shm: one tmpfs (oci_spec)
    if dev is not None:
        await asyncio.to_thread(dev.mkdir, mode=0o755)
    overlay = f"lowerdir={':'.join(pristine)},upperdir={upper},workdir={work},volatile"
    mounts = [
        _bind(untrusted_binary(), UNTRUSTED_IN_VERIFIER),
        _bind(root / "verify", VERIFY_DIR_IN_VERIFIER),
        _bind(root / "result", RESULT_DIR_IN_VERIFIER, writable=True),
        _bind(root / "home", HOME_IN_VERIFIER, writable=True),
        *protected.verifier_mounts(prepared),
        *(_graded_mount(path, g, rootfs) for path, g in sorted(snap.copies.items())),
    ]
    config = build_config(
        sandbox_id=vid,
        spec=rec.spec,
        rootfs=rootfs,
        agent_binary=backend.agent_binary,
        cgroup_path=backend.cgroup_of(vid),
        host_cpus=backend.host_cpus,
        extra_mounts=mounts,
        # The grader may run the agent's code: same seccomp profile, violations reported
        # as the sandbox's. No netns_path: a fresh empty network, whatever the rules.
        seccomp=backend.seccomp_profile(vid, report_as=rec.id),
        sys_mounts=backend.sys_mounts(vid),
        dev_tmpfs=dev,
    )
    config["hostname"] = rec.id  # the grader sees the same host name as the agent
    await backend.start_agent_container(
        vid, root, config, overlay=(rootfs, overlay), dev_tmpfs=dev, backlog=16
    )
    # Signals the grader's or the agent's code sends the verifier's pid 1 are the
    # graded sandbox's attempts (the watch ends with the verifier's teardown).
    backend.init_signals.watch(vid, sock, report_as=rec.id)
