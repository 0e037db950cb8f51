"""What the platform asks of the image subsystem (implemented in dsec.images.images)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from dsec.api.images import ImageInfo, PullResult
from dsec.api.layers import LayerInfo, LayerRef
from dsec.api.spec import LayeredRunArgs
from dsec.images.oci.auth import Credentials
from dsec.images.vmdisk import VMMachine

# Called with (step description, done units, total units or None) during long work.
Progress = Callable[[str, int, int | None], None]
ArchiveFormat = Literal["auto", "tar", "oci"]
Recipe = Literal["busybox", "debian-python"]


class ImageService(Protocol):
    async def resolve(self, ref: str) -> ImageInfo:
        """``name[:tag]`` -> image; raises ImageNotFound with the known names."""
        ...

    async def compose(self, spec: LayeredRunArgs) -> ImageInfo:
        """The base image of ``spec`` with its workspace and toolkit layers on top."""
        ...

    async def layer_digest(self, ref: LayerRef) -> tuple[str, int]:
        """(digest, size) of a layer reference; ImageNotFound with a hint if unknown."""
        ...

    async def list(self) -> list[ImageInfo]: ...

    async def pull(
        self, ref: str, *, credentials: Credentials | None = None, streaming: bool = True
    ) -> PullResult:
        """Pull from an OCI registry (dsec.images.oci)."""
        ...

    async def ensure(self, ref: str) -> ImageInfo:
        """Resolve, or pull a registry reference that is not here yet."""
        ...

    async def remove(self, ref: str) -> ImageInfo:
        """Forget the tag; layers no image references are deleted once unmounted."""
        ...

    async def import_directory(
        self, ref: str, path: Path, *, progress: Progress | None = None
    ) -> ImageInfo: ...

    async def add_vm_blob(
        self, chunks: AsyncIterator[bytes], *, progress: Progress | None = None
    ) -> tuple[str, int]:
        """A file of a VM image into the layer store as it is: (digest, size)."""
        ...

    async def register_layers(
        self, ref: str, layers: builtins.list[str], config: dict[str, object]
    ) -> ImageInfo:
        """Tag layers already on the platform, bottom first, as an image."""
        ...

    async def register_vm(
        self,
        ref: str,
        disk: str,
        *,
        kernel: str | None = None,
        initrd: str | None = None,
        cmdline: str | None = None,
    ) -> ImageInfo:
        """Tag stored blobs as a VM image (dsec.images.vmdisk), the disk inspected."""
        ...

    async def import_archive(
        self,
        ref: str,
        chunks: AsyncIterator[bytes],
        *,
        fmt: ArchiveFormat = "auto",
        progress: Progress | None = None,
    ) -> ImageInfo:
        """A plain rootfs tar, a `docker save` tar, or an OCI layout tar (whiteouts applied)."""
        ...

    async def build(
        self,
        recipe: Recipe,
        *,
        ref: str | None = None,
        rebuild: bool = False,
        progress: Progress | None = None,
    ) -> ImageInfo:
        """Built-in images: busybox:latest, debian-python:bookworm (cached)."""
        ...

    def layer_path(self, digest: str) -> Path:
        """The verified EROFS blob of a layer on this host."""
        ...


@runtime_checkable
class LayerBuilder(Protocol):
    """An image service that can take a layer made from a sandbox's changes (pack_diff,
    fork: dsec.rl.pack). Apart from ImageService, so a service without it still serves."""

    @property
    def layer_compression(self) -> str | None:
        """The EROFS compression new layers get on this host (None: none)."""
        ...

    def temp_layer_path(self) -> Path:
        """A fresh path in the layer store's file system for a layer being built."""
        ...

    def adding_layer(self, built: Path) -> contextlib.AbstractAsyncContextManager[tuple[str, int]]:
        """Move the EROFS file ``built`` into the store; yields (digest, size) while the
        garbage collector leaves the unreferenced blob alone (register it meanwhile)."""
        ...

    async def record_layer(self, info: LayerInfo) -> LayerInfo | None:
        """Register (or retag) a layer; returns the layer the name pointed at before."""
        ...

    async def gc(self) -> builtins.list[str]:
        """Remove blobs nothing refers to; returns their digests."""
        ...


@runtime_checkable
class VMSnapshotStore(Protocol):
    """An image service that can register a snapshot VM image (``sb.snapshot``:
    dsec.edge.vmsnapshot). Apart from ImageService, so a service without it still
    serves (and refuses snapshots with 501)."""

    async def register_vm_snapshot(
        self,
        ref: str,
        *,
        disk: str,
        state: str,
        machine: VMMachine,
        kernel: str | None,
        initrd: str | None,
        cmdline: str | None,
    ) -> ImageInfo:
        """Tag stored blobs as a VM image that restores ``state`` instead of booting."""
        ...


LayersWanted = Callable[[Mapping[str, int]], None]
"""Told the layers (``sha256:<hex>`` -> users now) a cache over budget cannot evict."""


@runtime_checkable
class LayerCacheBudget(Protocol):
    """An image service whose host layer cache has a budget (dsec.images.hostlayers).
    Apart from ImageService, so a service without a bounded cache still serves."""

    def on_layers_wanted(self, listener: LayersWanted) -> None:
        """Call ``listener`` (from any thread, holding no lock) with the layers the cache
        would evict to get under its budget but cannot, because something holds them,
        and how many users each has: a holder that can let go (a warm sandbox:
        dsec.edge.warmpool) and is a layer's only user should, and the cache evicts the
        layer when its last user releases it."""
        ...
