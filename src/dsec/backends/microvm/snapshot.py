"""Pause to a file, resume from it, and template snapshots (many VMs from one file).

A pause is a QEMU migration into a file: ``stop``, ``migrate fd:`` with a file we open
and pass over QMP (QEMU 7.2 has no ``file:`` URI, and ``exec:`` would need a shell, which
the ``-sandbox spawn=deny`` filter forbids anyway), wait for completion, then ``quit``
so the guest's memory goes back to the host. A resume starts a *new* QEMU with the same
command line plus ``-incoming defer`` and feeds it the file the same way.

A template is the same file written once from a guest that waits (``dsec.wait=1``)
before touching any drive: each restore is its own QEMU reading the one read-only file,
then told its own boot parameters over the agent channel. QEMU can only restore into
an identical machine (device set, -m, -smp, kernel), so templates are keyed by
``VMConfig.machine_key()`` (see ``template_path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.microvm.qemu import QemuProcess, VMConfig
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.errors import BackendError

SNAPSHOT_FD = "dsec-snapshot"
# QEMU's default migration bandwidth cap (128 MiB/s in 7.2) is for live migration
# over a network; into a local file from a stopped guest it only slows the pause.
UNLIMITED_BANDWIDTH = 1 << 40


@dataclass(frozen=True)
class SnapshotStats:
    seconds: float
    size: int


async def wait_migration(qmp: Qmp, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status", "none")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise BackendError(f"{what} failed: {info.get('error-desc', status)}")
        if time.monotonic() > deadline:
            with contextlib.suppress(QmpError):
                await qmp.execute("migrate_cancel")
            raise BackendError(f"{what} did not finish within {timeout}s (status {status})")
        await asyncio.sleep(0.005)


async def save_to_file(
    proc: QemuProcess, qmp: Qmp, path: Path, *, timeout: float = 60.0
) -> SnapshotStats:
    """Stop the guest and write its full state to ``path`` (atomically: a partial
    file never appears under that name), then end QEMU. On failure the VM is left
    running as it was and no file is left behind."""
    t0 = time.monotonic()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    stopped = False
    try:
        await qmp.execute("stop")
        stopped = True
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": UNLIMITED_BANDWIDTH})
        await qmp.send_fd(SNAPSHOT_FD, fd)
        await qmp.execute("migrate", {"uri": f"fd:{SNAPSHOT_FD}"})
        await wait_migration(qmp, timeout, "pause to file")
        await asyncio.to_thread(os.fsync, fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if stopped:
            with contextlib.suppress(QmpError):
                await qmp.execute("cont")
        raise
    finally:
        os.close(fd)
    with contextlib.suppress(QmpError):  # QEMU may close the socket before answering
        await qmp.execute("quit", timeout=2.0)
    await qmp.close()
    if not await asyncio.to_thread(proc.wait_exit, 5.0):
        await asyncio.to_thread(proc.kill)
    return SnapshotStats(time.monotonic() - t0, os.stat(path).st_size)


async def pause_to_file(
    proc: QemuProcess, qmp: Qmp, path: Path, *, timeout: float = 60.0
) -> SnapshotStats:
    """Pause: the guest's memory and device state go to ``path`` and the QEMU process
    ends (its memory is freed). ``resume_from_file`` brings it back."""
    return await save_to_file(proc, qmp, path, timeout=timeout)


async def load_into(qmp: Qmp, path: Path, *, timeout: float = 60.0) -> None:
    """Feed a QEMU started with ``-incoming defer`` the state saved in ``path`` (opened
    here, read only, passed over QMP) and let the guest run on. Any QEMU whose command
    line matches the saved one's: a microVM's (``restore_from_file``, ``Machine``) or a
    full VM's (dsec.backends.fullvm)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        await qmp.send_fd(SNAPSHOT_FD, fd)
        await qmp.execute("migrate-incoming", {"uri": f"fd:{SNAPSHOT_FD}"})
        await wait_migration(qmp, timeout, f"restore from {path.name}")
        await qmp.execute("cont")
    finally:
        os.close(fd)


async def restore_from_file(
    config: VMConfig,
    path: Path,
    *,
    prefix: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    timeout: float = 60.0,
) -> tuple[QemuProcess, Qmp]:
    """Start a new QEMU for ``config`` (same machine as the one saved) that loads
    ``path`` and runs on from where it stopped. The file is only read (templates are
    shared by many restores). Kills the new QEMU on any failure."""
    proc: QemuProcess | None = None
    qmp: Qmp | None = None
    try:
        proc = QemuProcess.launch(
            dataclasses.replace(config, incoming=path), prefix=prefix, pass_fds=pass_fds
        )
        qmp = await Qmp.connect(config.qmp_socket, alive=proc.is_alive)
        await load_into(qmp, path, timeout=timeout)
        return proc, qmp
    except BaseException as exc:
        tail = proc.log_tail() if proc is not None else ""
        if qmp is not None:
            await qmp.close()
        if proc is not None:
            await asyncio.to_thread(proc.kill)
        if isinstance(exc, BackendError) and tail:
            raise BackendError(f"{exc.message}; QEMU said: {tail}") from exc
        raise


async def resume_from_file(
    config: VMConfig,
    path: Path,
    *,
    prefix: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    timeout: float = 60.0,
    remove: bool = True,
) -> tuple[QemuProcess, Qmp]:
    """Resume a paused VM; the snapshot file is removed once the guest runs again
    (``remove=False`` keeps it)."""
    proc, qmp = await restore_from_file(
        config, path, prefix=prefix, pass_fds=pass_fds, timeout=timeout
    )
    if remove:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return proc, qmp


def template_path(directory: Path, config: VMConfig) -> Path:
    """Where the template snapshot for ``config``'s machine lives (keyed by
    ``config.machine_key()``: only a VM with that same shape can restore it)."""
    return directory / f"template-{config.machine_key()}.vmstate"


async def save_template(
    proc: QemuProcess, qmp: Qmp, config: VMConfig, directory: Path, *, timeout: float = 60.0
) -> Path:
    """Save a booted, waiting guest as the template for its machine key (ends QEMU).
    The file is made read-only: every restore shares it."""
    os.makedirs(directory, exist_ok=True)
    path = template_path(directory, config)
    await save_to_file(proc, qmp, path, timeout=timeout)
    os.chmod(path, 0o444)
    return path


async def restore_template(
    config: VMConfig,
    directory: Path,
    *,
    prefix: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    timeout: float = 60.0,
) -> tuple[QemuProcess, Qmp]:
    """A new VM from the template for ``config``'s machine key (BackendError if
    there is none: the caller cold-boots, and may save one for next time)."""
    path = template_path(directory, config)
    if not await asyncio.to_thread(path.is_file):
        raise BackendError(f"no template snapshot for machine {config.machine_key()}")
    return await restore_from_file(config, path, prefix=prefix, pass_fds=pass_fds, timeout=timeout)
