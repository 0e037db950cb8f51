"""``sb.snapshot("name:tag")``: a running full VM saved as a VM image others start from
without booting.

The edge's part: the name is checked (422) and must be free (409 ``already_exists``:
a snapshot never replaces an image others may be starting from; remove the old tag
first), the sandbox must be running and its backend must declare
``Capability.SNAPSHOT`` (else 501 before any work); the sandbox is held exclusive (no
pause, stop or second snapshot interleaves) while its backend captures the state and
the flattened disk (dsec.backends.fullvm.capture) into the image store's file system;
both files then go into the store content-addressed, kept from the garbage collector
until the image is registered (``register_vm_snapshot``), so a
snapshot image is fetched, listed and collected like an imported one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol, cast

from dsec.api.events import AuditKind
from dsec.api.fields import parse_image_ref
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.backends.base import Capability
from dsec.edge.edge import Edge
from dsec.errors import (
    AlreadyExists,
    ImageNotFound,
    InvalidArgument,
    SandboxNotRunning,
    Unsupported,
)
from dsec.images.service import LayerBuilder, VMSnapshotStore
from dsec.images.vmdisk import VMImage


class _Store(LayerBuilder, VMSnapshotStore, Protocol):
    """What a snapshot needs of the image service: blobs in, a snapshot image tagged."""


class NameLocks:
    """One snapshot per target name at a time on this edge (the free-name check and
    the registration must not interleave with another snapshot to that name); an
    entry lives while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        """How many names are held or waited for."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(name, (asyncio.Lock(), 0))
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)


_names = NameLocks()


async def snapshot(edge: Edge, sandbox_id: str, ref: str) -> ImageInfo:
    """Save the running VM ``sandbox_id`` as the VM image ``ref`` (name[:tag])."""
    t0 = time.monotonic()
    try:
        name, tag = parse_image_ref(ref)
    except ValueError as exc:
        raise InvalidArgument(str(exc), ref=ref) from None
    full = f"{name}:{tag}"
    rec = edge.running_record(sandbox_id)
    backend = edge.backend_of(rec, Capability.SNAPSHOT)  # 501 before any work
    images = edge.images
    if not isinstance(images, LayerBuilder) or not isinstance(images, VMSnapshotStore):
        raise Unsupported("this edge's image service cannot store VM snapshots")
    store = cast(_Store, images)
    source = VMImage.of(rec.image.config, rec.spec.image_ref)
    async with _names.hold(full):
        await _check_free(edge, full)
        state_out, disk_out = store.temp_layer_path(), store.temp_layer_path()
        try:
            async with edge.exclusive(sandbox_id):
                if rec.state is not SandboxState.RUNNING:
                    raise SandboxNotRunning(
                        f"sandbox {sandbox_id} is {rec.state.value}", state=rec.state
                    )
                machine = await edge.call_running(
                    sandbox_id,
                    lambda r: backend.snapshot(r, state_out=state_out, disk_out=disk_out),
                )
            async with (
                store.adding_layer(disk_out) as (disk, _),
                store.adding_layer(state_out) as (state, _),
            ):
                info = await store.register_vm_snapshot(
                    full,
                    disk=disk,
                    kernel=source.kernel,
                    initrd=source.initrd,
                    cmdline=source.cmdline,
                    state=state,
                    machine=machine,
                )
        finally:
            for left in (state_out, disk_out):  # consumed by the store on success
                with contextlib.suppress(FileNotFoundError):
                    await asyncio.to_thread(Path.unlink, left)
    edge.audit.record(
        sandbox_id,
        AuditKind.LIFECYCLE,
        "snapshot",
        image=full,
        digest=info.digest,
        seconds=round(time.monotonic() - t0, 3),
    )
    return info


async def _check_free(edge: Edge, ref: str) -> None:
    try:
        await edge.images.resolve(ref)
    except ImageNotFound:
        return
    raise AlreadyExists(
        f"image {ref} exists: a snapshot never replaces an image (remove it first)", image=ref
    )
