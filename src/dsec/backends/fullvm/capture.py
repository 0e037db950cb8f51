"""Capture a running full VM as a snapshot: its memory and device state, and its disk,
consistent with each other, while the VM stays frozen across both.

The sequence, all on the live QEMU:

1. ``stop``: every vCPU stops; nothing in the guest runs until step 4.
2. ``migrate`` into a file we open and pass over QMP (as a pause does,
   dsec.backends.microvm.snapshot): RAM and device state. When a migration completes
   QEMU flushes and *inactivates* its block nodes (the destination would own them
   now): the overlay is complete on disk and QEMU writes nothing to it meanwhile.
3. ``qemu-img convert`` of the overlay chain (the sandbox's overlay over its image's
   disk) into one standalone qcow2: the captured disk, a new file no sandbox can
   write, which the image store then keeps content-addressed like an imported disk.
4. ``cont``: QEMU re-activates its block nodes and the guest runs on, unaware.

Why ``qemu-img convert`` and not QEMU's own ``blockdev-backup``/``drive-mirror``: the
jailed QEMU can only open the files its jail showed it at spawn, so a new target
file would have to be passed in as an fd and added as a node; the copy would also run
inside the sandbox's cgroup and time. ``convert`` runs on the host from files that
are quiescent (step 2), flattens the chain in one pass and writes a fresh file.
The overlay's header is guest-VMM writable, so its backing file is never taken from
it: the chain is named on the command line (``--image-opts``), and the overlay must
not name an external data file.

qemu-img parses that QEMU-written header, so it runs confined like the QEMU it copies
for (``jail``: dsec-vmjail as the VM's own QEMU uid, no capabilities, empty network,
a root holding /usr, the overlay and base read-only and the new file, nothing else),
never as root on the host: a header crafted to exploit qemu-img gains no more than the
taken-over QEMU that wrote it already had. The copy is not charged to the sandbox's
cgroup (the platform makes it, on its own time). The new file is handed back to root
and made read-only before the store inspects it (no backing or data file, as any
imported disk) and keeps it.

On any failure the VM is continued and the partial files are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.microvm.jail import Jail
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.backends.microvm.snapshot import SNAPSHOT_FD, UNLIMITED_BANDWIDTH, wait_migration
from dsec.errors import BackendError
from dsec.images.vmdisk import DiskFormat

CONVERT_TIMEOUT = 1800.0  # seconds: a multi-GiB disk on a slow host


@dataclass(frozen=True)
class Captured:
    frozen_seconds: float  # how long the guest did not run
    state_bytes: int
    disk_bytes: int


def qemu_img_binary() -> str:
    """qemu-img's absolute path (the jail execs it without a PATH search)."""
    found = shutil.which("qemu-img")
    if found is None:
        raise BackendError("qemu-img is not installed (apt-get install qemu-utils)")
    return os.path.realpath(found)


def _check_overlay(overlay: Path, prefix: Sequence[str]) -> None:
    """The overlay must not name an external data file (its header is QEMU-written)."""
    argv = [*prefix, qemu_img_binary(), "info", "--output=json", "-f", "qcow2", "-U"]
    try:
        proc = subprocess.run(
            [*argv, str(overlay)], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendError(f"qemu-img could not read the VM's overlay: {exc}") from exc
    if proc.returncode != 0:
        raise BackendError(f"qemu-img could not read the VM's overlay: {proc.stderr[-400:]}")
    out = proc.stdout
    try:
        doc = json.loads(out)
    except ValueError as exc:
        raise BackendError(f"qemu-img info gave no JSON: {exc}") from exc
    specific = doc.get("format-specific") if isinstance(doc, dict) else None
    data = specific.get("data") if isinstance(specific, dict) else None
    if isinstance(data, dict) and data.get("data-file"):
        raise BackendError("the VM's overlay names an external data file: not captured")


def convert_argv(overlay: Path, base: Path, base_format: DiskFormat, out: Path) -> list[str]:
    """``qemu-img convert`` of the overlay over ``base`` (forced on the command line,
    never read from the overlay's header) into the standalone qcow2 ``out``."""
    for path in (overlay, base):
        if "," in str(path):
            raise BackendError(f"a VM path contains a comma: {path}")
    source = (
        f"driver=qcow2,file.driver=file,file.filename={overlay},"
        f"backing.driver={base_format},backing.file.driver=file,"
        f"backing.file.filename={base},backing.read-only=on"
    )
    # -U: QEMU released its image locks when the migration completed (its nodes are
    # inactive), but a lock left by a VMM we cannot see must not fail the capture.
    return [
        qemu_img_binary(), "convert", "-q", "-U", "--image-opts", source, "-O", "qcow2", str(out)
    ]  # fmt: skip


async def _convert(argv: list[str], out: Path) -> None:
    """Run ``argv`` as a child we can end: a cancelled snapshot kills the copy at once
    instead of leaving a thread writing a file nobody will remove."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), CONVERT_TIMEOUT)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()[-400:]
        raise BackendError(f"qemu-img could not capture the VM's disk: {text}")
    await asyncio.to_thread(os.chown, out, 0, 0)  # the jail chowned it to the VM's uid
    await asyncio.to_thread(os.chmod, out, 0o444)


async def capture(
    qmp: Qmp,
    *,
    overlay: Path,
    base: Path,
    base_format: DiskFormat,
    state_out: Path,
    disk_out: Path,
    jail: Jail | None = None,
    timeout: float = 600.0,
) -> Captured:
    """Save the VM's state to ``state_out`` and its disk to ``disk_out`` with the VM
    frozen across both, then let it run on; both files removed on failure. ``jail``:
    how qemu-img is confined (the VM's QEMU's uid, ``Jail.as_uid``; None: unconfined,
    for tests without root)."""
    t0 = time.monotonic()
    fd = os.open(state_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    stopped = False
    read_prefix: list[str] = []
    copy_prefix: list[str] = []
    try:
        if jail is not None:  # the jail binds the output file: it must exist
            os.close(os.open(disk_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            read_prefix = jail.prefix_for(ro=[overlay], rw=[], kvm=False)
            copy_prefix = jail.prefix_for(ro=[overlay, base], rw=[disk_out], kvm=False)
        await asyncio.to_thread(_check_overlay, overlay, read_prefix)
        await qmp.execute("stop")
        stopped = True
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": UNLIMITED_BANDWIDTH})
        await qmp.send_fd(SNAPSHOT_FD, fd)
        await qmp.execute("migrate", {"uri": f"fd:{SNAPSHOT_FD}"})
        await wait_migration(qmp, timeout, "snapshot of the VM's state")
        await asyncio.to_thread(os.fsync, fd)
        argv = [*copy_prefix, *convert_argv(overlay, base, base_format, disk_out)]
        await _convert(argv, disk_out)
    except BaseException:
        if stopped:  # a migration in flight must not complete once the VM runs on
            with contextlib.suppress(QmpError):
                await asyncio.shield(qmp.execute("migrate_cancel"))
        for partial in (state_out, disk_out):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)  # cheap, and must run even when cancelled
        raise
    finally:
        os.close(fd)
        if stopped:
            with contextlib.suppress(QmpError):
                await asyncio.shield(qmp.execute("cont"))
    frozen = time.monotonic() - t0
    state_size = (await asyncio.to_thread(state_out.stat)).st_size
    return Captured(frozen, state_size, (await asyncio.to_thread(disk_out.stat)).st_size)


# What a VM an edge left between ``stop`` and ``cont`` reports (QMP query-status):
# stopped, mid-way through its state's save, or after it.
INTERRUPTED = frozenset({"paused", "finish-migrate", "postmigrate"})


async def resume_interrupted(qmp: Qmp) -> bool:
    """Continue a VM whose capture never reached its ``cont`` (the edge died between):
    a migration still in flight is cancelled first. True if it was frozen. For a VM
    that should be running (not a job-paused one: that is SIGSTOPped, not stopped)."""
    if await qmp.status() not in INTERRUPTED:
        return False
    with contextlib.suppress(QmpError):
        await qmp.execute("migrate_cancel")
    await qmp.execute("cont")
    return True
