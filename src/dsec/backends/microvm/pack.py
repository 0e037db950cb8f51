"""pack_diff and fork for microVMs: the agent's changes as a layer, read by a packer VM.

A container's changes are its overlay upper on the host, which mkfs.erofs reads as is
(dsec.backends.container.freezer). A microVM's upper lives on an ext4 disk the agent
wrote block by block as root; the host kernel never mounts it. So, like the verify step
(dsec.backends.microvm.verify, whose machinery this reuses), a *packer VM* parses it:

1. The agent's VM is held still: a running one is synced and stopped (SIGSTOP) for the
   whole step and continued after; a paused one stays paused (one whose QEMU still
   exists is continued only for the sync). A VM paused to its file was synced when it
   was saved (``reclaim``).
2. The packer VM boots from the sandbox's pristine layers with a copy-on-write view of
   the agent's disk (``dsec-agent``, backed by a read-only fd) and an empty raw drive
   ``dsec-out``; its /init (dsec-vminit.c, pack mode) writes the view's ``upper/`` as a
   tar in the OCI layer convention to that drive, reports ``verify/packed`` (or
   ``verify/error``), and the VM is removed.
3. The host reads that tar as hostile input (dsec.images.difftar: no traversal, no link
   followed, no device node but whiteouts, no xattr of the guest's, at most the disk's
   size of data), leaving out the same paths as a container's pack (platform mounts,
   protected paths), and runs mkfs.erofs on the tree: a layer containers and microVMs
   both start from, like any other.

A guest kernel crashed by a crafted disk fails the pack (typed BackendError), it never
reaches the host; a dishonest packer can only produce a tar, which is treated as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.backends.base import PackedWritable
from dsec.backends.container.freezer import excluded_paths
from dsec.backends.microvm.qemu import Drive
from dsec.backends.microvm.verify import (
    AGENT_FDSET,
    ERROR_IN_VERIFIER,
    VIEW,
    boot_verifier,
    create_view,
    layer_drives,
    read_small,
    remove_verifier,
    sync_guest,
    view_drive,
)
from dsec.errors import BackendError, Conflict, LimitExceeded
from dsec.guest.bootparams import PACK_DISK_SERIAL, BootParams
from dsec.images.difftar import DiffTree, write_diff_tree
from dsec.images.store import mkfs_erofs
from dsec.sessions.agent_client import AgentClient

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.backends.microvm.backend import MicroVMBackend

SUFFIX = ".k"  # never a sandbox id: a sweep removes a leftover packer
PACK_TIMEOUT = 600.0  # boot plus writing the tar of a whole disk, on a loaded TCG host
PACKED_IN_VERIFIER = "/.dsec/verify/packed"
OUT = "out.tar"
TOO_MANY = "do not fit the pack drive"  # dsec-vminit.c's words when the tar outgrows it


def _read_tar(tar: Path, tree: Path, excluded: list[str], max_bytes: int) -> DiffTree:
    with open(tar, "rb") as stream:
        return write_diff_tree(stream, tree, excluded=excluded, max_bytes=max_bytes)


def packer_id(sandbox_id: str) -> str:
    return sandbox_id + SUFFIX


def out_size(disk_bytes: int) -> int:
    """The tar drive: the disk's data plus headers (a disk of N bytes holds at most
    N/4 KiB entries of 1.5 KiB of headers each) and the end blocks, sparse."""
    return disk_bytes + disk_bytes // 2 + (16 << 20)


async def pack_writable(
    backend: MicroVMBackend,
    rec: SandboxRecord,
    out: Path,
    *,
    compression: str | None,
    paused: bool,
) -> PackedWritable:
    if rec.id in backend.verifying:
        raise Conflict(f"sandbox {rec.id} is being verified or packed; wait for that to end")
    backend.verifying.add(rec.id)
    try:
        stopped = await _hold_still(backend, rec, paused=paused)
        try:
            return await _pack(backend, rec, out, compression=compression)
        finally:
            await asyncio.shield(remove_verifier(backend, packer_id(rec.id)))
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
                machine = backend.machine_of(rec.id)
                if machine is not None:
                    machine.stopped = False
    finally:
        backend.verifying.discard(rec.id)


async def _hold_still(backend: MicroVMBackend, rec: SandboxRecord, *, paused: bool) -> int | None:
    """Sync and stop the agent's QEMU; the pid to continue afterwards (None: leave it)."""
    machine = backend.machine_of(rec.id)
    proc = machine.proc if machine is not None else None
    if machine is None or proc is None or not proc.is_alive():
        if not paused:
            raise BackendError(f"microvm {rec.id} has no running VMM")
        return None  # paused to its file: its disk was synced before the save
    if paused:  # stopped by the pause: continued for the sync only
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
    await sync_guest(backend, rec)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except ProcessLookupError as exc:
        raise BackendError(f"microvm {rec.id}: its VMM is gone") from exc
    machine.stopped = True
    return None if paused else proc.pid


async def _pack(
    backend: MicroVMBackend, rec: SandboxRecord, out: Path, *, compression: str | None
) -> PackedWritable:
    kid = packer_id(rec.id)
    root = backend.vm_dir(kid)
    disk = backend.vm_dir(rec.id) / "disk.img"
    deadline = time.monotonic() + PACK_TIMEOUT
    await remove_verifier(backend, kid)  # what an earlier step's cleanup left (idempotent)
    root.mkdir(mode=0o700)
    (root / "q").mkdir(mode=0o700)
    await asyncio.to_thread(create_view, disk, root / VIEW)
    disk_bytes = os.stat(disk).st_size
    tar = root / OUT
    fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, out_size(disk_bytes))
    finally:
        os.close(fd)
    disk_fd = os.open(disk, os.O_RDONLY | os.O_CLOEXEC)
    try:
        drives = [*layer_drives(backend, rec), view_drive(root)]
        drives.append(Drive(tar, PACK_DISK_SERIAL, readonly=False))
        params = BootParams(
            layers=len(rec.image.layers),
            rw=False,
            hostname=rec.id[:63],
            time_us=time.time_ns() // 1000,
            verify=True,
            pack=True,
        )
        machine = await boot_verifier(
            backend, rec, kid, tuple(drives), ((disk_fd, AGENT_FDSET),), params, deadline
        )
    finally:
        os.close(disk_fd)
    client = AgentClient(machine.agent_socket)
    error = await read_small(client, ERROR_IN_VERIFIER, 4096)
    status = await read_small(client, PACKED_IN_VERIFIER, 256)
    await machine.kill()  # the tar is complete and synced: nothing more of the guest
    if error or status is None:
        why = (error or "the packer reported nothing").strip()
        if TOO_MANY in why:  # the agent's own doing (e.g. millions of hard links)
            raise LimitExceeded(f"microvm {rec.id}: cannot pack its disk: {why}")
        raise BackendError(f"microvm {rec.id}: cannot pack its disk: {why}")
    excluded = excluded_paths(rec, None)
    tree = out.with_name(f".{out.name}.tree")
    try:
        diff = await asyncio.to_thread(_read_tar, tar, tree, excluded, disk_bytes)
        await mkfs_erofs(out, tree, compression=compression)
    finally:
        await asyncio.to_thread(shutil.rmtree, tree, True)
    return PackedWritable(files=diff.entries, excluded=excluded)
