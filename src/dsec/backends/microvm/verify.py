"""The trusted verify step for microVMs: the grader in a fresh verifier VM that boots
from the sandbox's PRISTINE layers, the agent's disk reaching it only as data.

The container verifier (dsec.backends.container.verifier) is the model; what differs is
where the agent's work is parsed. A container verifier copies the graded trees on the
host; a microVM's work is an ext4 file system the agent wrote as root, block by block,
which the host kernel must never mount. So the *verifier guest's* kernel parses it, and
a crash there is contained by that VM (the step fails closed):

1. The agent is asked to ``sync`` (10 s, failure ignored: a hostile agent only loses its
   own unsynced work), then its QEMU is stopped (SIGSTOP: every vCPU at once). It stays
   stopped for the whole step. ``fresh`` mode (the default) kills it afterwards (the
   sandbox ends stopped, the edge's part); ``isolated`` mode lets it continue.
2. ``view.qcow2``: a throwaway copy-on-write view of the agent's ``disk.img`` (its
   backing file is passed to the verifier's QEMU as a READ-ONLY fd, ``/dev/fdset/1``),
   so the verifier's guest may replay the ext4 journal while the real disk is never
   written, and the verifier's QEMU (another uid) needs no access to the disk's path.
3. The verifier VM: the sandbox's pristine layers (the same read-only drives), a tmpfs
   upper (no disk of its own), the protected sources as read-only EROFS drives
   ``dsec-p<i>`` (never attached to the agent's VM), the agent view as ``dsec-agent``,
   no network device. dsec-vminit's verifier mode (dsec-vminit.c) mounts the view in
   the initramfs root (unreachable after the root switch) and shows the agent's changes
   under each graded path read-only over the pristine content, walked without
   following anything and mounted ``nosymfollow`` (stricter than the container's rule,
   which keeps a link that resolves inside its graded tree: here no planted link is
   followed at all, and each refused graded root is listed in ``refused``). Started
   from a template of its machine shape when one exists (saved after the first cold
   boot of that shape), like any microVM.
4. The grader runs through the verifier's agent with the container verifier's fixed
   environment, user, working directory, timeout and output caps; results come from
   ``/.dsec/result`` (bounded). The verifier VM is killed and every file of it removed
   after the step, whatever happens.

Fails closed, with ``passed=False`` and ``error``: an agent disk the verifier's kernel
cannot mount or without a real ``upper/`` directory (``scan_incomplete`` event), a
verifier that does not boot or dies (e.g. a kernel crash on a hostile file system), any
error before the grader ran. After an edge crash mid-step, ``recover`` (called when the
agent's VM is re-adopted) ends the verifier first, then continues the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsec import linux
from dsec.api.events import EventKind
from dsec.api.verify import GradedRefusal, VerifyRequest, VerifyResult
from dsec.backends.container.verifier import (
    DEFAULT_VERIFY_TIMEOUT,
    MAX_RESULT_BYTES,
    MAX_RESULT_FILES,
    RESULT_DIR_IN_VERIFIER,
    grader_env,
    not_run,
)
from dsec.backends.microvm import snapshot
from dsec.backends.microvm.backend import (
    QEMU_PIDS,
    microvm_spec,
)
from dsec.backends.microvm.machine import Machine, wait_until
from dsec.backends.microvm.qemu import Drive, find_running
from dsec.errors import BackendError, Conflict, DSecError
from dsec.guest.bootparams import AGENT_DISK_SERIAL, BootParams, layer_serial, protected_serial
from dsec.security.graded_paths import resolve_graded
from dsec.sessions import protocol as p
from dsec.sessions.agent_client import AgentClient

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.backends.microvm.backend import MicroVMBackend

log = logging.getLogger(__name__)

SUFFIX = ".v"  # never a sandbox id: a sweep removes a leftover verifier
SYNC_TIMEOUT = 10.0
BOOT_TIMEOUT = 120.0  # a cold TCG boot takes ~3 s; a loaded CI host much more
AGENT_FDSET = 1
VIEW = "view.qcow2"
REFUSED_IN_VERIFIER = "/.dsec/verify/refused"
ERROR_IN_VERIFIER = "/.dsec/verify/error"
MAX_REFUSED_BYTES = 64 * 1024


class _Phases:
    """Where a step's time goes (logged at INFO once per step)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.marks: list[str] = []

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.marks.append(f"{name} {1000 * (now - self.last):.0f}ms")
        self.last = now


async def sync_guest(backend: MicroVMBackend, rec: SandboxRecord) -> None:
    """Ask the guest to write its page cache to its disk (bounded; failure ignored: a
    hostile or hung agent only loses its own unsynced work)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            backend.agent(rec).exec(
                ["sync"],
                env={},
                cwd="/",
                user="root",
                timeout=SYNC_TIMEOUT,
                max_output=4096,
                stdin=None,
            ),
            SYNC_TIMEOUT + 2,
        )


def layer_drives(backend: MicroVMBackend, rec: SandboxRecord) -> list[Drive]:
    """The sandbox's pristine read-only layers, top first (``dsec-l0`` is the top)."""
    return [
        Drive(backend.layers.blob(d), layer_serial(i), readonly=True)
        for i, d in enumerate(reversed(rec.image.layers))
    ]


def view_drive(root: Path) -> Drive:
    """The agent's disk as a helper VM sees it: ``root/view.qcow2`` (create_view). No
    lock on the backing disk: its own QEMU holds one and is stopped meanwhile."""
    return Drive(
        root / VIEW,
        AGENT_DISK_SERIAL,
        readonly=False,
        format="qcow2",
        options="backing.file.locking=off",
    )


def verifier_id(sandbox_id: str) -> str:
    return sandbox_id + SUFFIX


def create_view(disk: Path, view: Path) -> None:
    """A qcow2 whose backing file is the fd set QEMU gets (never the disk's path)."""
    size = os.stat(disk).st_size
    try:
        subprocess.run(
            [
                *("qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", "raw"),
                *("-b", f"/dev/fdset/{AGENT_FDSET}", str(view), str(size)),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except FileNotFoundError as exc:
        raise BackendError("qemu-img not found: apt-get install qemu-utils") from exc
    except subprocess.CalledProcessError as exc:
        raise BackendError(f"qemu-img create: {exc.stderr.decode(errors='replace')}") from exc
    os.chmod(view, 0o600)


async def run_verify(
    backend: MicroVMBackend, rec: SandboxRecord, req: VerifyRequest
) -> VerifyResult:
    graded = list(req.graded) if req.graded is not None else resolve_graded(rec.spec, req)
    if rec.id in backend.verifying:
        raise Conflict(f"sandbox {rec.id} is already being verified; wait for that to end")
    backend.verifying.add(rec.id)
    try:
        return await _verify(backend, rec, req, graded)
    finally:
        backend.verifying.discard(rec.id)


async def _verify(
    backend: MicroVMBackend, rec: SandboxRecord, req: VerifyRequest, graded: list[str]
) -> VerifyResult:
    machine = backend.running_machine(rec)
    assert machine.proc is not None
    agent_pid = machine.proc.pid
    phases = _Phases()
    # 1. sync, then stop the agent's VM for the whole step.
    await sync_guest(backend, rec)
    phases.mark("sync")
    try:
        os.kill(agent_pid, signal.SIGSTOP)
    except ProcessLookupError as exc:
        raise BackendError(f"microvm {rec.id}: its VMM is gone") from exc
    machine.stopped = True  # not polled over QMP meanwhile
    vid = verifier_id(rec.id)
    try:
        try:
            return await _in_verifier(backend, rec, req, graded, vid, phases)
        finally:
            await asyncio.shield(remove_verifier(backend, vid))
            phases.mark("cleanup")
            log.info("microvm %s: verify (%s): %s", rec.id, req.mode, ", ".join(phases.marks))
    finally:
        if req.mode == "fresh":
            await asyncio.shield(machine.kill())  # the edge then ends the sandbox stopped
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent_pid, signal.SIGCONT)
            machine.stopped = False


async def _in_verifier(
    backend: MicroVMBackend,
    rec: SandboxRecord,
    req: VerifyRequest,
    graded: list[str],
    vid: str,
    phases: _Phases,
) -> VerifyResult:
    facts = backend.facts(rec)
    root = backend.vm_dir(vid)
    deadline = time.monotonic() + BOOT_TIMEOUT
    disk_fd = -1
    await remove_verifier(backend, vid)  # what an earlier step's cleanup left (idempotent)
    try:
        root.mkdir(mode=0o700)
        (root / "q").mkdir(mode=0o700)
        disk = backend.vm_dir(rec.id) / "disk.img"
        await asyncio.to_thread(create_view, disk, root / VIEW)
        phases.mark("view")
        # Read-only: whatever the verifier's QEMU does, the agent's disk is not written.
        disk_fd = os.open(disk, os.O_RDONLY | os.O_CLOEXEC)
        drives = layer_drives(backend, rec)
        drives += [
            Drive(Path(source), protected_serial(i), readonly=True)
            for i, (_path, source) in enumerate(facts.protected)
        ]
        drives.append(view_drive(root))
        params = BootParams(
            layers=len(rec.image.layers),
            rw=False,
            hostname=rec.id[:63],  # the grader sees the agent's host name
            time_us=time.time_ns() // 1000,
            verify=True,
            graded=tuple(graded),
            protected=tuple(path for path, _source in facts.protected),
        )
        machine = await boot_verifier(
            backend, rec, vid, tuple(drives), ((disk_fd, AGENT_FDSET),), params, deadline, phases
        )
    except DSecError as exc:
        log.warning("microvm %s: the verifier did not start: %s", rec.id, exc)
        return not_run(req, graded, f"the verifier did not start: {exc}")
    finally:
        if disk_fd >= 0:
            os.close(disk_fd)  # QEMU holds its own copy
    phases.mark("boot")
    client = AgentClient(machine.agent_socket)
    try:
        error = await read_small(client, ERROR_IN_VERIFIER, 4096)
        if error is None and not await file_exists(client, REFUSED_IN_VERIFIER):
            error = "the verifier did not prepare the graded paths"
        if error:
            backend.audit.event(
                rec.id, EventKind.SCAN_INCOMPLETE, what="graded agent disk", reason=error[:300]
            )
            return not_run(req, graded, f"the graded tree cannot be read: {error.strip()}")
        refused = _parse_refused(await read_small(client, REFUSED_IN_VERIFIER, MAX_REFUSED_BYTES))
        if refused:
            backend.audit.event(
                rec.id,
                EventKind.GRADED_LINK_ESCAPE,
                count=len(refused),
                refused=[f"{path}: {why}" for path, why in refused[:20]],
            )
        phases.mark("checks")
        res = await client.exec(
            ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else req.command,
            env=grader_env(rec, req),
            cwd=req.workdir or "/",
            user=req.user or "root",
            timeout=req.timeout or DEFAULT_VERIFY_TIMEOUT,
            max_output=req.max_output_bytes,
            stdin=req.stdin.encode() if req.stdin is not None else None,
        )
        phases.mark("grader")
        results = await _read_results(client)
        phases.mark("results")
    except DSecError as exc:
        alive = machine.proc is not None and machine.proc.is_alive()
        why = "the verifier died" if not alive else "the verifier failed"
        log.warning("microvm %s: %s during the step: %s", rec.id, why, exc)
        return not_run(req, graded, f"{why}: {exc}")
    out = res.as_exec_result()
    return VerifyResult(
        **out.model_dump(),
        passed=out.exit_code == 0 and not out.timed_out,
        mode=req.mode,
        graded=graded,
        refused=[GradedRefusal(path=path, reason=why) for path, why in refused],
        results=results,
    )


def _parse_refused(text: str | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for line in (text or "").splitlines():
        path, _, why = line.partition("\t")
        if path:
            out.append((path, why or "not shown"))
    return out


async def file_exists(client: AgentClient, path: str) -> bool:
    try:
        await client.fs(p.FS_STAT, path, user="root")
    except DSecError:
        return False
    return True


async def read_small(client: AgentClient, path: str, limit: int) -> str | None:
    """A platform file of the verifier (never the agent's), or None if missing."""
    if not await file_exists(client, path):
        return None
    data = await client.read_file(path, user="root", max_bytes=limit)
    return data.decode(errors="replace")


async def _read_results(client: AgentClient) -> dict[str, str]:
    """The regular files the grader left in its result directory (bounded)."""
    try:
        entries, _ = await client.fs(p.FS_LIST, RESULT_DIR_IN_VERIFIER, user="root")
    except DSecError:
        return {}
    out: dict[str, str] = {}
    for entry in sorted(entries, key=lambda e: e.name)[:MAX_RESULT_FILES]:
        if "/" in entry.name or not stat.S_ISREG(entry.mode):
            continue
        path = f"{RESULT_DIR_IN_VERIFIER}/{entry.name}"
        with contextlib.suppress(DSecError):
            data = await client.read_file(path, user="root", max_bytes=MAX_RESULT_BYTES)
            out[entry.name] = data.decode(errors="replace")
    return out


async def boot_verifier(
    backend: MicroVMBackend,
    rec: SandboxRecord,
    vid: str,
    drives: tuple[Drive, ...],
    fdsets: tuple[tuple[int, int], ...],
    params: BootParams,
    deadline: float,
    phases: _Phases | None = None,
) -> Machine:
    """Start the verifier VM (restored from a template of its shape when one exists,
    else booted cold, a template then saved in the background), in a cgroup of its
    own with the sandbox's limits, jailed like every QEMU, and wait for its agent."""
    kernel, initrd, accel = await backend.guest()
    spec = microvm_spec(rec)
    base = backend.vm_config(vid, spec, kernel, initrd, accel, drives, None)
    config = dataclasses.replace(base, fdsets=fdsets)
    await asyncio.to_thread(
        backend.cgroups.create_limited,
        backend.cgroup_of(vid),
        memory_bytes=backend.cgroup_memory_bytes(spec),
        cpu_cores=spec.cpu_cores_limit,
        pids=QEMU_PIDS,
    )
    # The sandbox's private protected images (root 0600 in its directory) are given to
    # this QEMU's uid; layer blobs are shared and readable as they are.
    private = backend.vm_dir(rec.id)
    own = tuple(d.path for d in drives if d.readonly and d.path.parent == private)
    jail = dataclasses.replace(backend.jail_for(vid), own_ro=own)
    machine = Machine(backend.vm_dir(vid), config)
    backend.track(vid, machine)
    template = snapshot.template_path(backend.templates_dir, config)
    restored = backend.templates and template.is_file()
    try:
        async with machine.lock:
            machine.listen()
            machine.launch(prefix=jail.prefix(config), incoming=restored)
            if restored:
                await machine.restore(template, wait_until(deadline))
            mark = phases.mark if phases is not None else (lambda _name: None)
            mark("restore" if restored else "launch")
            channel = await machine.connect_channel(wait_until(deadline))
            await channel.wait_template(wait_until(deadline))
            mark("waiting")
            await channel.go(params.params())
            await channel.wait_ready(wait_until(deadline))
            mark("guest")
    except BaseException as exc:
        tail = await machine.console_tail(300)
        if not tail and machine.proc is not None:
            tail = machine.proc.log_tail(300)  # QEMU's own words when it ended
        if isinstance(exc, BackendError) and tail:
            raise BackendError(f"{exc.message}; the verifier's console said: {tail}") from exc
        raise
    # Signals sent to the verifier's pid 1 are the graded sandbox's attempts.
    backend.init_signals.watch(vid, machine.agent_socket, report_as=rec.id)
    if backend.templates and not restored:
        # The template boots on placeholder drives: no view, no fd set (neither is part
        # of the machine's shape, so the key is this config's).
        plain = tuple(dataclasses.replace(d, format="raw", options="") for d in config.drives)
        backend.build_template_later(dataclasses.replace(config, drives=plain, fdsets=()))
    return machine


def _stopped(pid: int) -> bool:
    st = linux.proc_stat(pid)
    return st is not None and st.stopped


async def recover(backend: MicroVMBackend, sandbox_id: str, agent_pid: int) -> None:
    """After an edge crash during a verify of a RUNNING sandbox: end the verifier first
    (its QEMU, cgroup and files: it reads the agent's disk), then continue the agent's
    stopped QEMU, as the container verifier's recovery thaws. A few stat calls when
    there is nothing to do."""
    vid = verifier_id(sandbox_id)
    for proc in await asyncio.to_thread(find_running, backend.vms_dir):
        if proc.qmp_socket.parent.parent.name == vid:
            await asyncio.to_thread(proc.kill)
    parent = backend.cgroup_of(vid).rpartition("/")[0]
    if backend.vm_dir(vid).exists() or vid in backend.cgroups.children(parent):
        await remove_verifier(backend, vid)
    if _stopped(agent_pid):
        log.warning("microvm %s: stopped by an unfinished verify step; continued", sandbox_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent_pid, signal.SIGCONT)


async def remove_verifier(backend: MicroVMBackend, vid: str) -> None:
    """Kill the verifier's QEMU, remove its cgroup and every file (idempotent)."""
    backend.init_signals.unwatch(vid)
    machine = backend.untrack(vid)
    if machine is not None:
        await machine.kill()
        machine.close_listener()
    ok = await asyncio.to_thread(backend.cgroups.kill_and_remove, backend.cgroup_of(vid), timeout=5)
    await asyncio.to_thread(shutil.rmtree, backend.vm_dir(vid), True)
    if not ok or backend.vm_dir(vid).exists():
        log.warning("cleanup of verifier %s incomplete (the next sweep removes it)", vid)
