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

On any failure the VM is continued and the partial files are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.backends.microvm.snapshot import SNAPSHOT_FD, UNLIMITED_BANDWIDTH, wait_migration
from dsec.errors import BackendError
from dsec.images.vmdisk import DiskFormat, qemu_img

CONVERT_TIMEOUT = 1800.0  # seconds: a multi-GiB disk on a slow host


@dataclass(frozen=True)
class Captured:
    frozen_seconds: float  # how long the guest did not run
    state_bytes: int
    disk_bytes: int


def _check_overlay(overlay: Path) -> None:
    """The overlay must not name an external data file (its header is QEMU-written)."""
    out = qemu_img(
        ["info", "--output=json", "-f", "qcow2", "-U", str(overlay)],
        "read the VM's overlay",
    )
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
    return ["qemu-img", "convert", "-q", "-U", "--image-opts", source, "-O", "qcow2", str(out)]


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
    await asyncio.to_thread(os.chmod, out, 0o444)


async def capture(
    qmp: Qmp,
    *,
    overlay: Path,
    base: Path,
    base_format: DiskFormat,
    state_out: Path,
    disk_out: Path,
    timeout: float = 600.0,
) -> Captured:
    """Save the VM's state to ``state_out`` and its disk to ``disk_out`` with the VM
    frozen across both, then let it run on; both files removed on failure."""
    t0 = time.monotonic()
    fd = os.open(state_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    stopped = False
    try:
        await asyncio.to_thread(_check_overlay, overlay)
        await qmp.execute("stop")
        stopped = True
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": UNLIMITED_BANDWIDTH})
        await qmp.send_fd(SNAPSHOT_FD, fd)
        await qmp.execute("migrate", {"uri": f"fd:{SNAPSHOT_FD}"})
        await wait_migration(qmp, timeout, "snapshot of the VM's state")
        await asyncio.to_thread(os.fsync, fd)
        await _convert(convert_argv(overlay, base, base_format, disk_out), disk_out)
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
