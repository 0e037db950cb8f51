"""The verifier: a short-lived container that sees the agent's files *and* the
protected content, which the agent's own sandbox never contains.

Root fs = overlay of (the agent's writable upper dir, read as a lower) over the agent's
layers, with a private upper of its own, so the grader can write scratch files without
touching the agent's; the protected sources are bind-mounted read-only at their paths,
*on top of* whatever the agent put there (a planted /grader/expected.txt is hidden). It
is a separate crun container: its own pid, mount, ipc, uts and network namespaces, so
nothing in the agent's sandbox can reach it through /proc. pid 1 is the same agent as
in every sandbox, so user names, env, workdir, timeouts and output caps behave exactly
as for ``exec``.

While it runs the agent's cgroup is frozen: overlayfs must not see a lower layer change
under a mount that uses it, and the agent must not swap its solution mid-grading.
Freezing costs ~0.2 ms whatever the upper's size (a copy, even with reflinks where the
file system has them, grows with the number of files). The agent is thawed after the
verifier is gone: also when the command fails, times out or the create fails.
(The kernel logs "lowerdir is in-use as upperdir" once per verify: expected, and the
freeze is what makes it safe.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.backends.container.oci_spec import build_config
from dsec.errors import BackendError, Conflict
from dsec.model import ExecRequest, ExecResult
from dsec.security import protected
from dsec.sessions.agent_client import AgentClient

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.backends.container.backend import ContainerBackend

log = logging.getLogger(__name__)

# A verify without a timeout would keep the agent frozen forever.
DEFAULT_VERIFY_TIMEOUT = 600.0
SUFFIX = ".v"


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


async def _cleanup(backend: ContainerBackend, vid: str, runtime: dict[str, Any]) -> None:
    try:
        await backend._teardown(vid, runtime)
    except Exception as exc:  # the edge's sweep removes what is left at its next start
        log.warning("cleanup of verifier %s incomplete: %s", vid, exc)


async def run_verify(backend: ContainerBackend, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
    """Start the verifier, run ``req`` in it as pid 1's child, kill it, thaw the agent;
    the rest of the teardown runs in the background (see Verifiers)."""
    state = backend.verifiers
    if rec.id in state.busy:
        raise Conflict(f"sandbox {rec.id} is already being verified; wait for that to end")
    state.busy.add(rec.id)
    try:
        await state.settle(rec.id)
        return await _verify(backend, rec, req)
    finally:
        state.busy.discard(rec.id)


async def _verify(backend: ContainerBackend, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
    vid = verifier_id(rec.id)
    root = backend._dir(vid)
    prepared = [protected.Prepared.from_json(p) for p in rec.runtime.get("protected", [])]
    runtime: dict[str, Any] = {"layers_held": []}
    rel = backend._cgroup(rec.id)
    await asyncio.to_thread(protected.freeze, backend.cgroups, rel)
    dead = False
    try:
        try:
            await _start(backend, rec, vid, root, backend._dir(rec.id), prepared, runtime)
            argv = ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else req.command
            res = await AgentClient(backend._socket(vid)).exec(
                argv,
                env=backend._env(rec, req.env),
                cwd=req.workdir or rec.spec.workdir,
                user=req.user or "root",
                timeout=req.timeout or DEFAULT_VERIFY_TIMEOUT,
                max_output=req.max_output_bytes,
                stdin=req.stdin.encode() if req.stdin is not None else None,
            )
        finally:
            # Once every verifier process is dead its overlay has no reader left, and
            # the agent may change its files again.
            dead = await asyncio.shield(
                asyncio.to_thread(backend.cgroups.kill_all, backend._cgroup(vid), timeout=5.0)
            )
            if not dead:
                await asyncio.shield(backend._teardown(vid, runtime))
    finally:
        try:
            await asyncio.shield(asyncio.to_thread(protected.thaw, backend.cgroups, rel))
        finally:
            if dead:
                backend.verifiers.cleanups[rec.id] = asyncio.create_task(
                    _cleanup(backend, vid, runtime), name=f"dsec-verifier-cleanup-{vid}"
                )
    return res.as_exec_result()


async def recover(backend: ContainerBackend, sandbox_id: str) -> None:
    """After an edge crash during a verify: remove the verifier, then thaw the agent
    (in that order: no reader may see the agent's upper change). A few stat calls when
    there is nothing to do. Never touches a verify this process is running."""
    if sandbox_id in backend.verifiers.busy or sandbox_id in backend.verifiers.cleanups:
        return
    vid = verifier_id(sandbox_id)
    parent = backend._cgroup(vid).rpartition("/")[0]
    if (
        backend._dir(vid).exists()
        or vid in backend.runtime.list_ids()
        or vid in backend.cgroups.children(parent)
    ):
        await backend._teardown(vid, {"layers_held": []})
    rel = backend._cgroup(sandbox_id)
    if await asyncio.to_thread(protected.is_frozen, backend.cgroups, rel):
        await asyncio.to_thread(protected.thaw, backend.cgroups, rel)


async def _start(
    backend: ContainerBackend,
    rec: SandboxRecord,
    vid: str,
    root: Path,
    sandbox_dir: Path,
    prepared: list[protected.Prepared],
    runtime: dict[str, Any],
) -> None:
    sock = backend._socket(vid)
    if len(os.fsencode(sock)) > 107:
        raise BackendError(f"verifier socket path too long ({sock}); use a shorter --data-dir")
    rootfs, upper, work = root / "rootfs", root / "upper", root / "work"
    for d in (rootfs, upper, work):
        d.mkdir(parents=True, exist_ok=False)
    lowers = [str(sandbox_dir / "upper")]
    for digest in reversed(rec.image.layers):
        lowers.append(str(backend.layers.acquire(digest)))
        runtime["layers_held"].append(digest)
    overlay = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},volatile"
    config = build_config(
        sandbox_id=vid,
        spec=rec.spec,
        rootfs=rootfs,
        agent_binary=backend.agent_binary,
        cgroup_path=backend._cgroup(vid),
        host_cpus=backend.host_cpus,
        extra_mounts=protected.verifier_mounts(prepared),
        # The grader runs the agent's code: same seccomp profile, violations reported
        # as the sandbox's. No netns_path: a fresh empty network, whatever the rules.
        seccomp=backend.seccomp_profile(vid, report_as=rec.id),
    )
    config["hostname"] = rec.id  # the grader sees the same host name as the agent
    (root / "config.json").write_text(json.dumps(config))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(sock))
        listener.listen(16)
        async with backend._runtime_slots:
            await backend.runtime.run_detached(
                vid, root, root / "init.pid", agent_fd=listener.fileno(), overlay=(rootfs, overlay)
            )
    finally:
        listener.close()
    with contextlib.suppress(OSError, ValueError):
        runtime["pid"] = int((root / "init.pid").read_text().strip())
