"""The image subsystem of one host: layer store + registry table + host mount cache.

Layout under ``root`` (``PlatformConfig.images_dir``, e.g. /var/lib/dsec/images)::

    blobs/sha256/<hex>       EROFS layer blobs, read-only, named by their SHA-256
    verified/sha256/<hex>    "verified at this inode/size/mtime/ctime" markers
    mnt/sha256/<hex>         host mount points of layers (mode 0700 parent)
    cache/<recipe>/rootfs    cached debootstrap trees (rebuilds only rerun mkfs.erofs);
                             elsewhere with build_cache (DSEC_BUILD_CACHE), shared
    tmp/<pid>-<rand>         uploads and extraction trees; stale ones removed on open()

Importers flatten to one layer for now, but a manifest is a list of layers so base,
workspace and toolkit layers can be stacked later without a format change.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import ParamSpec, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from dsec.api.fields import parse_image_ref
from dsec.api.images import ImageInfo, PullResult
from dsec.api.layers import LayerInfo, LayerRef
from dsec.api.spec import LayeredRunArgs
from dsec.errors import BackendError, CorruptBlob, ImageNotFound, InvalidArgument
from dsec.images import builders, vmdisk
from dsec.images.chunkindex import DEFAULT_CHUNK_SIZE, build_index
from dsec.images.extract import default_config, unpack_archive
from dsec.images.hostlayers import HostLayers
from dsec.images.layer_registry import LayerRegistry
from dsec.images.lazy.daemon import LazyDaemon
from dsec.images.lazy.renew import keep_fresh
from dsec.images.mounts import LayerMounts
from dsec.images.oci.auth import Credentials
from dsec.images.oci.client import RegistrySettings
from dsec.images.oci.pull import Puller
from dsec.images.oci.reference import names_registry
from dsec.images.registry import ImageRow, NewLayer, Registry, manifest_layers, utc
from dsec.images.remote.client import RemoteStore
from dsec.images.service import ArchiveFormat, LayersWanted, Progress, Recipe
from dsec.images.store import LayerStore, normalize_digest, remove_tree

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

RECIPES: dict[str, str] = {
    "busybox": "busybox:latest",
    "debian-python": "debian-python:bookworm",
}
MANIFEST_MEDIA_TYPE = "application/vnd.dsec.image.manifest.v1+json"
# Bumped when extraction changes, so an identical re-upload is not matched to a layer
# an older importer built.
EXTRACT_VERSION = 1
# A blob on disk that no image and no layer row knows may be an import in flight in
# another process; it is only collected after this long.
ORPHAN_GRACE_SECONDS = 3600.0
SPOOL_BUFFER = 4 << 20


def _canonical(doc: object) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _parse_ref(ref: str) -> tuple[str, str]:
    try:
        return parse_image_ref(ref)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _safe(progress: Progress | None) -> Progress:
    """A progress callback that can never break a build."""

    def report(step: str, done: int, total: int | None) -> None:
        if progress is None:
            return
        try:
            progress(step, done, total)
        except Exception:  # a broken UI callback must not fail the build
            log.exception("progress callback failed")

    return report


def _from_thread(progress: Progress) -> Progress:
    """Deliver progress from a worker thread on the event loop, where callers expect it."""
    loop = asyncio.get_running_loop()

    def report(step: str, done: int, total: int | None) -> None:
        loop.call_soon_threadsafe(progress, step, done, total)

    return report


class Images:
    """ImageService for one host (see dsec.images.service)."""

    def __init__(
        self,
        root: Path,
        engine: AsyncEngine,
        *,
        compression: str | None = None,
        busybox: Path = builders.HOST_BUSYBOX,
        remote: RemoteStore | None = None,
        lazy: LazyDaemon | None = None,
        cache_bytes: int = 20 << 30,
        registries: RegistrySettings | None = None,
        build_cache: Path | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root))
        # Recipes' cached trees (see build); another directory may be shared by several
        # image roots of one host (PlatformConfig.build_cache_dir): one debootstrap.
        self.build_cache = Path(os.path.abspath(build_cache or self.root / "cache"))
        self.store = LayerStore(self.root)
        self.remote = remote
        self.lazy = lazy
        self.layer_registry = LayerRegistry(engine)
        self.indexes: dict[str, str] = {}  # blob digest -> chunk index digest
        self.host = HostLayers(
            self.store,
            remote=remote,
            daemon=lazy,
            cache_bytes=cache_bytes,
            index_of=self.indexes.get,
        )
        self.mounts = LayerMounts(self.root, self.store, provider=self.host)
        self.host.mounts = self.mounts
        self.registry = Registry(engine)
        self.compression = compression
        self.busybox = busybox
        self._cache: dict[tuple[str, str], ImageInfo] = {}
        self._lock = asyncio.Lock()  # registry writes and garbage collection
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._pending: set[str] = set()  # built, not yet registered: never collected
        self._held: dict[str, int] = {}  # digests a pull in flight will reference
        self.puller = Puller(self, registries or RegistrySettings())
        self._pull_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._renewer: asyncio.Task[None] | None = None  # the lazy loader's token

    def on_layers_wanted(self, listener: LayersWanted) -> None:
        """See dsec.images.service.LayerCacheBudget."""
        self.host.wanted_listeners.append(listener)

    # -- lifecycle --

    async def open(self) -> None:
        """Create directories and tables, load the registry, adopt existing mounts."""
        await asyncio.to_thread(self.store.open)
        self.build_cache.mkdir(parents=True, exist_ok=True)
        await self.registry.create_tables()
        await self.layer_registry.create_tables()
        await self._reload()
        self.indexes.update(await self.layer_registry.indexes())
        if self.lazy is not None:
            if self.remote is not None:
                self.lazy.authorization = await self.remote.lazy_authorization()
            # Before adopting mounts: lazy layers are adopted only if their daemon is.
            await asyncio.to_thread(self.lazy.start)
            if self.remote is not None:
                self._renewer = asyncio.create_task(keep_fresh(self.remote, self.lazy))
        await asyncio.to_thread(self.mounts.adopt_existing)

    async def close(self, *, nothing_live: bool = False) -> None:
        """Unmount layers no sandbox uses; used ones stay for the next run to adopt
        (and so does the lazy daemon while any lazily loaded layer is mounted).
        ``nothing_live``: no sandbox outlives this process, so every layer goes
        (LayerMounts.close)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        await asyncio.to_thread(self.mounts.close, nothing_live=nothing_live)
        if self.lazy is not None and not any(self.host.is_lazy(d) for d in self.mounts.mounted()):
            try:
                await asyncio.to_thread(self.lazy.stop)
            except BackendError as exc:  # the next start cleans up what is left
                log.warning("lazy layer daemon not stopped: %s", exc)
        if self.remote is not None:
            await self.remote.close()

    def invalidate(self) -> None:
        """Forget cached lookups (another process changed the registry)."""
        self._cache.clear()

    # -- lookups --

    async def resolve(self, ref: str) -> ImageInfo:
        """``name[:tag]`` -> image, from memory when possible (sandbox-create hot path)."""
        name, tag = _parse_ref(ref)
        info = self._cache.get((name, tag))
        if info is None:
            info = await self._lookup(name, tag)
            if info is None:
                raise await self._not_found(name, tag)
        return info.model_copy(deep=True)

    async def ensure(self, ref: str) -> ImageInfo:
        """Resolve ``ref`` here, or pull it when it names a registry (a registry host or
        a digest) and is not here yet: what a run spec and a Dockerfile ``FROM`` use.
        Plain local names (``busybox:latest``) are never pulled implicitly."""
        try:
            return await self.resolve(ref)
        except ImageNotFound:
            if not names_registry(ref):
                raise
        return (await self.pull(ref, missing_only=True)).image

    async def pull(
        self,
        ref: str,
        *,
        credentials: Credentials | None = None,
        streaming: bool = True,
        force: bool = False,
        missing_only: bool = False,
    ) -> PullResult:
        """Pull ``ref`` from its registry (dsec.images.oci.pull) and store it under the
        name it was asked by. Concurrent pulls of one reference share the work: the
        second finds the first's image (unless ``force``: re-check the registry). A
        tag is looked up in the registry again (it may have moved) unless
        ``missing_only``; a digest never is."""
        name, tag = _parse_ref(ref)
        lock = self._pull_locks.setdefault((name, tag), asyncio.Lock())
        async with lock:
            if not force:
                existing = await self._lookup(name, tag)
                if existing is not None and (missing_only or tag.startswith("sha256-")):
                    # a digest cannot move; a concurrent ensure() pulled it already
                    return PullResult(
                        image=existing.model_copy(deep=True),
                        source=ref,
                        manifest_digest="",
                        layers=[],
                        bytes_fetched=0,
                        seconds=0.0,
                    )
            return await self.puller.pull(
                ref, name, tag, credentials=credentials, streaming=streaming
            )

    async def compose(self, spec: LayeredRunArgs) -> ImageInfo:
        """The image a sandbox starts from: base layers, then workspace, then toolkit.

        The base is an image tag or, failing that, a layer of the layer registry (local,
        then the shared store). Each reference is resolved to a digest now, so a sandbox
        keeps exactly the layers it started with when a tag moves on.
        """
        try:
            base = await self.ensure(spec.image_ref)
        except ImageNotFound as exc:
            try:
                as_layer = LayerRef.parse(spec.image_ref)
            except ValueError:
                raise exc from None
            layer = await self.find_layer(as_layer)
            if layer is None:
                raise exc from None
            base = self._layer_image(layer)
        if "vm" in base.config:
            raise InvalidArgument(
                f"image {spec.image_ref} is a VM image: start it with the fullvm backend "
                "(run_fullvm)",
                image=spec.image_ref,
            )
        extra = [ref for ref in (spec.workspace, spec.toolkit) if ref is not None]
        if not extra:
            return base
        layers = list(base.layers)
        size = base.size_bytes
        for ref in extra:
            digest, size_bytes = await self.layer_digest(ref)
            layers.append(digest)
            size += size_bytes
        manifest = _canonical({"base": base.digest, "layers": layers})
        return base.model_copy(
            update={
                "layers": layers,
                "size_bytes": size,
                "digest": "sha256:" + hashlib.sha256(manifest.encode()).hexdigest(),
            },
            deep=True,
        )

    async def find_layer(self, ref: LayerRef) -> LayerInfo | None:
        """A named layer: the local registry, else the shared store (then recorded here)."""
        if ref.name is None or ref.version is None:
            return None
        info = await self.layer_registry.get(ref.name, ref.version)
        if info is None and self.remote is not None:
            info = await self.remote.get_ref(ref.name, ref.version)
            if info is not None:
                await self.record_layer(info)
        return info

    @property
    def layer_compression(self) -> str | None:
        return self.compression

    def temp_layer_path(self) -> Path:
        return self.store.temp_path(".erofs")

    @contextlib.asynccontextmanager
    async def adding_layer(self, built: Path) -> AsyncIterator[tuple[str, int]]:
        try:
            digest = await asyncio.to_thread(self.store.add_file, built)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(built.unlink, missing_ok=True))
            raise
        self._pending.add(digest)  # built, not yet tagged: the GC must not take it
        try:
            yield digest, self.store.size(digest)
        finally:
            self._pending.discard(digest)

    @contextlib.asynccontextmanager
    async def built_layer(self, tree: Path) -> AsyncIterator[str]:
        """Build ``tree`` into an EROFS layer in the store and yield its digest, which the
        garbage collector leaves alone until the block ends: register it (record_layer)
        inside the block, or it is collectable afterwards."""
        digest = await self._build_layer(tree)
        try:
            yield digest
        finally:
            self._pending.discard(digest)

    async def delete_layer_tag(self, name: str, version: str) -> LayerInfo | None:
        """Remove a layer tag; returns the entry it had, None if there was none. The
        layer's blob stays until gc() finds nothing else refers to it."""
        async with self._lock:
            return await self.layer_registry.delete(name, version)

    async def record_layer(self, info: LayerInfo) -> LayerInfo | None:
        """Register or move a layer tag; returns the previous entry, if any."""
        async with self._lock:
            before = await self.layer_registry.put(info)
        if info.index_digest is not None:
            self.indexes[info.digest] = info.index_digest
        return before

    async def layer_digest(self, ref: LayerRef) -> tuple[str, int]:
        """(digest, size) of a layer reference; ImageNotFound with a hint if unknown."""
        if ref.digest is not None:
            size = await asyncio.to_thread(self._local_size, ref.digest)
            if size is None and self.remote is not None:
                size = await self.remote.blob_size(ref.digest)
            if size is None:
                raise ImageNotFound(f"layer {ref.digest} is in no layer store", ref=str(ref))
            return ref.digest, size
        info = await self.find_layer(ref)
        if info is None:
            known = [i.ref for i in await self.layer_registry.all()][:20]
            raise ImageNotFound(
                f"layer {ref} not found. Known layers: {', '.join(known) or 'none yet'}. "
                "Build one (dsec layer build) or pull it (dsec layer pull).",
                ref=str(ref),
                known=known,
            )
        return info.digest, info.size_bytes

    def _local_size(self, digest: str) -> int | None:
        try:
            return self.store.size(digest)
        except ImageNotFound:
            return None

    def _layer_image(self, layer: LayerInfo) -> ImageInfo:
        config = dict(layer.config) if layer.config else default_config()
        manifest = _canonical({"layers": [layer.digest], "config": config})
        return ImageInfo(
            name=layer.name,
            tag=layer.version,
            digest="sha256:" + hashlib.sha256(manifest.encode()).hexdigest(),
            layers=[layer.digest],
            size_bytes=layer.size_bytes,
            created_at=layer.created_at,
            config=config,
        )

    async def list(self) -> builtins.list[ImageInfo]:
        await self._reload()
        return [info.model_copy(deep=True) for _, info in sorted(self._cache.items())]

    def layer_path(self, digest: str) -> Path:
        """The verified EROFS blob of a layer (CorruptBlob if it does not hash right)."""
        return self.store.verify(digest)

    async def verify(self, ref: str) -> ImageInfo:
        """Re-hash every layer of an image in full (CorruptBlob on a mismatch)."""
        info = await self.resolve(ref)
        for digest in info.layers:
            await asyncio.to_thread(self.store.verify, digest, force=True)
        return info

    # -- removal --

    async def remove(self, ref: str) -> ImageInfo:
        """Forget the tag; layers no image references are deleted once unmounted."""
        name, tag = _parse_ref(ref)
        async with self._lock:
            row = await self.registry.delete(name, tag)
            self._cache.pop((name, tag), None)
        if row is None:
            raise await self._not_found(name, tag)
        await self.gc()
        return self._to_info(row)

    async def gc(self) -> builtins.list[str]:
        """Delete layers no image references and no sandbox has mounted.

        A layer still mounted by a sandbox is kept and collected by a later call (after
        its users release it). Returns the digests deleted.
        """
        removed: builtins.list[str] = []
        async with self._lock:
            referenced = await self.registry.referenced_layers()
            referenced |= await self.layer_registry.referenced()
            known = {row.digest for row in await self.registry.layers()}
            on_disk = set(await asyncio.to_thread(self.store.digests))
            now = time.time()
            forget: builtins.list[str] = []
            for digest in sorted((known | on_disk) - referenced - self._pending - set(self._held)):
                if digest in on_disk:
                    if digest not in known and not self._older_than_grace(digest, now):
                        continue
                    if not self.mounts.unmount(digest):
                        continue  # a sandbox still uses it
                    await asyncio.to_thread(self.store.delete, digest)
                    removed.append(digest)
                if digest in known:
                    forget.append(digest)
            await self.registry.delete_layers(forget)
        if removed:
            log.info("deleted %d unreferenced layers", len(removed))
        return removed

    # -- importers --

    async def import_directory(
        self, ref: str, path: Path, *, progress: Progress | None = None
    ) -> ImageInfo:
        """The tree at ``path`` as it is (ownership, modes, mtimes, xattrs kept)."""
        name, tag = _parse_ref(ref)
        report = _safe(progress)
        path = await asyncio.to_thread(self._check_import_dir, Path(path))
        report("building EROFS layer", 0, 1)
        digest = await self._build_layer(path)
        report("building EROFS layer", 1, 1)
        return await self._commit(name, tag, [self._new_layer(digest)], default_config())

    async def import_archive(
        self,
        ref: str,
        chunks: AsyncIterator[bytes],
        *,
        fmt: ArchiveFormat = "auto",
        progress: Progress | None = None,
    ) -> ImageInfo:
        """A plain rootfs tar, a `docker save` tar, or an OCI layout tar (whiteouts applied).

        The upload is streamed to disk, never held in memory; gzip, bzip2 and xz are
        recognised by their magic bytes. Uploading the same bytes again reuses the
        layer built the first time.
        """
        name, tag = _parse_ref(ref)
        if fmt not in ("auto", "tar", "oci"):
            raise InvalidArgument(f"unknown archive format {fmt!r}: use auto, tar or oci")
        report = _safe(progress)
        async with self.work_dir() as work:
            upload = work / "upload"
            source_digest = await self._spool(chunks, upload, report)
            source = f"archive:{fmt}:v{EXTRACT_VERSION}:{source_digest}"
            reused = await self._reuse(name, tag, source)
            if reused is not None:
                report("reused the layer of an identical earlier upload", 1, 1)
                return reused
            rootfs = work / "rootfs"
            rootfs.mkdir(mode=0o755)
            report("extracting", 0, None)
            unpacked = await _in_thread(
                unpack_archive,
                upload,
                rootfs,
                fmt=fmt,
                scratch=work,
                ref_hint=f"{name}:{tag}",
                progress=_from_thread(report),
            )
            await asyncio.to_thread(upload.unlink)
            report(f"building EROFS layer ({unpacked.entries} entries)", 0, 1)
            digest = await self._build_layer(rootfs)
            report("building EROFS layer", 1, 1)
        config = unpacked.config or default_config()
        layer = self._new_layer(digest, source=source, config=config)
        return await self._commit(name, tag, [layer], config)

    # -- VM images (dsec.images.vmdisk) --

    async def add_vm_blob(
        self, chunks: AsyncIterator[bytes], *, progress: Progress | None = None
    ) -> tuple[str, int]:
        """One file of a VM image (disk, kernel or initrd) into the layer store as it
        is, content-addressed; (digest, size). Until an image names it, it is an
        orphan blob that ``gc`` collects after the grace period."""
        report = _safe(progress)
        async with self.work_dir() as work:
            upload = work / "blob"
            await self._spool(chunks, upload, report)
            size = (await asyncio.to_thread(upload.stat)).st_size
            digest = await asyncio.to_thread(self.store.add_file, upload)
        return digest, size

    async def register_vm(
        self,
        ref: str,
        disk: str,
        *,
        kernel: str | None = None,
        initrd: str | None = None,
        cmdline: str | None = None,
        state: str | None = None,
        machine: vmdisk.VMMachine | None = None,
    ) -> ImageInfo:
        """Tag blobs already in the store as a VM image: the disk is inspected first
        (raw or self-contained qcow2 only, vmdisk.inspect), a kernel command line
        needs a kernel. ``state`` and ``machine`` make a snapshot image (the edge's
        ``sb.snapshot``, dsec.edge.vmsnapshot; not offered over the import API: a
        saved state is only ever one QEMU wrote)."""
        name, tag = _parse_ref(ref)
        if (initrd is not None or cmdline is not None) and kernel is None:
            raise InvalidArgument("an initrd or a kernel command line needs a kernel")
        if (state is None) != (machine is None):
            raise InvalidArgument("a saved VM state needs its machine, and only it")
        digests = [normalize_digest(d) for d in (disk, kernel, initrd, state) if d is not None]
        paths = []
        for digest in digests:
            try:
                paths.append(await asyncio.to_thread(self.store.verify, digest))
            except ImageNotFound:
                raise InvalidArgument(
                    f"blob {digest} is not in the layer store: upload it first"
                ) from None
        fmt = await asyncio.to_thread(vmdisk.detect_format, paths[0])
        info = await asyncio.to_thread(vmdisk.inspect, paths[0], fmt)
        vm = vmdisk.VMImage(
            disk=digests[0],
            format=fmt,
            virtual_size=info.virtual_size,
            kernel=normalize_digest(kernel) if kernel is not None else None,
            initrd=normalize_digest(initrd) if initrd is not None else None,
            cmdline=vmdisk.check_cmdline(cmdline) if cmdline is not None else None,
            state=normalize_digest(state) if state is not None else None,
            machine=machine,
        )
        layers = [
            NewLayer(
                digest=d, size_bytes=await asyncio.to_thread(self.store.size, d), source=f"vm:{d}"
            )
            for d in vm.blobs()
        ]
        self._pending.update(vm.blobs())
        return await self._commit(name, tag, layers, vm.to_config())

    async def register_layers(
        self, ref: str, layers: builtins.list[str], config: dict[str, object]
    ) -> ImageInfo:
        """Tag layers already on this host, bottom first, as image ``ref`` with
        ``config``: a Dockerfile build stacks each step's packed layer on its base."""
        name, tag = _parse_ref(ref)
        new: builtins.list[NewLayer] = []
        async with self._lock:  # so that gc() cannot take a layer before the commit
            for digest in (normalize_digest(d) for d in layers):
                size = self._local_size(digest)
                if size is None:
                    raise InvalidArgument(f"layer {digest} is not on this platform")
                new.append(NewLayer(digest=digest, size_bytes=size, source=None))
            self._pending.update(layer.digest for layer in new)
        return await self._commit(name, tag, new, config)

    async def register_vm_snapshot(
        self,
        ref: str,
        *,
        disk: str,
        state: str,
        machine: vmdisk.VMMachine,
        kernel: str | None,
        initrd: str | None,
        cmdline: str | None,
    ) -> ImageInfo:
        """A snapshot VM image (dsec.service.VMSnapshotStore): ``register_vm`` with
        the saved state and its machine."""
        return await self.register_vm(
            ref,
            disk,
            kernel=kernel,
            initrd=initrd,
            cmdline=cmdline,
            state=state,
            machine=machine,
        )

    # -- builders --

    async def build(
        self,
        recipe: Recipe,
        *,
        ref: str | None = None,
        rebuild: bool = False,
        progress: Progress | None = None,
    ) -> ImageInfo:
        """Built-in images: busybox:latest, debian-python:bookworm (cached)."""
        if recipe not in RECIPES:
            raise InvalidArgument(
                f"unknown image recipe {recipe!r}; available: {', '.join(sorted(RECIPES))}"
            )
        name, tag = _parse_ref(ref or RECIPES[recipe])
        report = _safe(progress)
        lock = self._build_locks.setdefault(recipe, asyncio.Lock())
        async with lock:
            if not rebuild:
                existing = await self._lookup(name, tag)
                if existing is not None and all(self.store.exists(d) for d in existing.layers):
                    report("image exists", 1, 1)
                    return existing.model_copy(deep=True)
            if recipe == "busybox":
                digest = await self._busybox_layer(report)
                config = builders.BUSYBOX_CONFIG
            else:
                digest = await self._debian_layer(report)
                config = builders.DEBIAN_CONFIG
            info = await self._commit(name, tag, [self._new_layer(digest)], dict(config))
            report("done", 1, 1)
            return info

    async def _busybox_layer(self, report: Progress) -> str:
        async with self.work_dir() as work:
            tree = work / "rootfs"
            tree.mkdir()
            report("laying out busybox", 0, 2)
            await _in_thread(builders.busybox_tree, tree, self.busybox)
            report("building EROFS layer", 1, 2)
            return await self._build_layer(tree)

    async def _debian_layer(self, report: Progress) -> str:
        cache = self.build_cache / "debian-python-bookworm"
        tree = cache / "rootfs"
        stamp = cache / "recipe.json"
        cache.parent.mkdir(parents=True, exist_ok=True)
        async with _file_lock(cache.parent / "debian-python-bookworm.lock"):
            if not await asyncio.to_thread(_stamp_ok, stamp):
                await asyncio.to_thread(remove_tree, cache)
                cache.mkdir()
                staging = cache / "rootfs.partial"
                mirror = builders.debian_mirror()
                report(f"debootstrap bookworm from {mirror}", 0, None)
                try:
                    await builders.debootstrap(staging, mirror=mirror, progress=report)
                    await builders.customize_debian(staging, progress=report)
                    await asyncio.to_thread(os.rename, staging, tree)
                except BaseException:
                    await asyncio.shield(asyncio.to_thread(remove_tree, cache))
                    raise
                stamp_doc = {
                    "version": builders.DEBIAN_RECIPE_VERSION,
                    "mirror": mirror,
                    "built_at": datetime.now(UTC).isoformat(),
                }
                await asyncio.to_thread(stamp.write_text, json.dumps(stamp_doc))
            else:
                report("using the cached debootstrap tree", 0, None)
            report("building EROFS layer", 0, 1)
            return await self._build_layer(tree)

    # -- for importers of this package (dsec.images.oci) --

    @contextlib.asynccontextmanager
    async def temp_dir(self) -> AsyncIterator[Path]:
        """A private scratch directory in the store's file system, removed after."""
        async with self.work_dir() as path:
            yield path

    async def build_layer(self, tree: Path) -> str:
        """mkfs.erofs ``tree`` into the store; held (never collected) until released."""
        digest = await self._build_layer(tree)
        self.hold(digest)
        self._pending.discard(digest)
        return digest

    def hold(self, digest: str) -> None:
        """Keep ``digest`` from garbage collection until ``release`` (counted, so that
        two pulls sharing a layer each hold it)."""
        self._held[digest] = self._held.get(digest, 0) + 1

    def release(self, digest: str) -> None:
        left = self._held.get(digest, 0) - 1
        if left > 0:
            self._held[digest] = left
        else:
            self._held.pop(digest, None)

    async def commit(
        self, name: str, tag: str, layers: builtins.list[NewLayer], config: dict[str, object]
    ) -> ImageInfo:
        """Tag ``layers`` (bottom first, all in the store) as image ``name:tag``."""
        return await self._commit(name, tag, layers, config)

    async def publish_layer(self, info: LayerInfo) -> None:
        """Blob, chunk index and record of a layer to the shared store, if there is one
        (then other hosts find it by name and load it lazily)."""
        if self.remote is None:
            return
        blob = await asyncio.to_thread(self.store.verify, info.digest)
        index = await asyncio.to_thread(build_index, blob, DEFAULT_CHUNK_SIZE)
        await self.layer_registry.put_index(info.digest, index.digest, index.chunk_size)
        self.indexes[info.digest] = index.digest
        info = info.model_copy(update={"index_digest": index.digest})
        await self.remote.push_blob(info.digest, blob)
        await self.remote.push_index(info.digest, index.to_bytes())
        await self.remote.put_ref(info)
        await self.record_layer(info)

    # -- internals --

    async def _build_layer(self, tree: Path) -> str:
        digest = await self.store.build_erofs(tree, compression=self.compression)
        self._pending.add(digest)
        return digest

    def _new_layer(
        self, digest: str, *, source: str | None = None, config: dict[str, object] | None = None
    ) -> NewLayer:
        return NewLayer(
            digest=digest,
            size_bytes=self.store.size(digest),
            source=source,
            source_config=_canonical(config) if config is not None else None,
        )

    async def _commit(
        self, name: str, tag: str, layers: builtins.list[NewLayer], config: dict[str, object]
    ) -> ImageInfo:
        manifest = {
            "schemaVersion": 1,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "layers": [layer.digest for layer in layers],
            "config": config,
        }
        text = _canonical(manifest)
        digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
        try:
            async with self._lock:
                row, replaced = await self.registry.put(
                    name=name,
                    tag=tag,
                    digest=digest,
                    manifest=text,
                    size_bytes=sum(layer.size_bytes for layer in layers),
                    created_at=datetime.now(UTC),
                    layers=layers,
                )
                info = self._to_info(row)
                self._cache[(name, tag)] = info
        finally:
            for layer in layers:
                self._pending.discard(layer.digest)
        if replaced:
            await self.gc()
        return info.model_copy(deep=True)

    async def _reuse(self, name: str, tag: str, source: str) -> ImageInfo | None:
        """The image for an input we built a layer from before, if that layer is intact."""
        async with self._lock:  # so that gc() cannot delete it under our feet
            row = await self.registry.layer_by_source(source)
            if row is None:
                return None
            try:
                await asyncio.to_thread(self.store.verify, row.digest)
            except (ImageNotFound, CorruptBlob) as exc:
                log.warning("not reusing layer %s: %s", row.digest, exc)
                return None
            self._pending.add(row.digest)
        config = json.loads(row.source_config) if row.source_config else default_config()
        layer = NewLayer(digest=row.digest, size_bytes=row.size_bytes, source=source)
        return await self._commit(name, tag, [layer], config)

    async def _spool(self, chunks: AsyncIterator[bytes], dest: Path, report: Progress) -> str:
        """Write the upload to ``dest`` in 4 MiB batches (file I/O off the event loop);
        returns its digest."""
        h = hashlib.sha256()
        total = 0
        buf = bytearray()
        fh = await asyncio.to_thread(open, dest, "wb")
        try:

            def flush(data: bytes) -> None:
                fh.write(data)
                h.update(data)

            async for chunk in chunks:
                if not isinstance(chunk, bytes | bytearray | memoryview):
                    raise InvalidArgument("archive chunks must be bytes")
                buf += chunk
                if len(buf) >= SPOOL_BUFFER:
                    total += len(buf)
                    await asyncio.to_thread(flush, bytes(buf))
                    buf.clear()
                    report("receiving archive", total, None)
            if buf:
                total += len(buf)
                await asyncio.to_thread(flush, bytes(buf))
        finally:
            await asyncio.to_thread(fh.close)
        if total == 0:
            raise InvalidArgument("the archive is empty")
        report("received archive", total, total)
        return f"sha256:{h.hexdigest()}"

    @contextlib.asynccontextmanager
    async def work_dir(self) -> AsyncIterator[Path]:
        """A private scratch directory in the store's file system (so that what is built
        there moves into the store by rename), removed with all it holds on exit."""
        path = self.store.temp_path()
        await asyncio.to_thread(path.mkdir, 0o700, True)
        try:
            yield path
        finally:
            await asyncio.to_thread(remove_tree, path)

    async def _lookup(self, name: str, tag: str) -> ImageInfo | None:
        info = self._cache.get((name, tag))
        if info is not None:
            return info
        row = await self.registry.get(name, tag)
        if row is None:
            return None
        info = self._to_info(row)
        self._cache[(name, tag)] = info
        return info

    async def _reload(self) -> None:
        rows = await self.registry.all()
        self._cache = {(row.name, row.tag): self._to_info(row) for row in rows}

    async def _not_found(self, name: str, tag: str) -> ImageNotFound:
        rows = await self.registry.all()
        known = [f"{row.name}:{row.tag}" for row in rows]
        same_name = [r for r in known if r.split(":", 1)[0] == name]
        hint = f" Did you mean {', '.join(same_name)}?" if same_name else ""
        listing = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "") or "none yet"
        return ImageNotFound(
            f"image {name}:{tag} not found.{hint} Known images: {listing}. Build one "
            "(recipes: busybox, debian-python) or import a directory, rootfs tar or "
            "OCI/docker archive.",
            ref=f"{name}:{tag}",
            known=known,
        )

    def _to_info(self, row: ImageRow) -> ImageInfo:
        doc = json.loads(row.manifest)
        config = doc.get("config") if isinstance(doc, dict) else None
        return ImageInfo(
            name=row.name,
            tag=row.tag,
            digest=row.digest,
            layers=manifest_layers(row.manifest),
            size_bytes=row.size_bytes,
            created_at=utc(row.created_at),
            config=config if isinstance(config, dict) else {},
        )

    def _check_import_dir(self, path: Path) -> Path:
        path = path.resolve()
        if not path.is_dir():
            raise InvalidArgument(f"{path} is not a directory")
        if self.root.resolve().is_relative_to(path):
            raise InvalidArgument(f"{path} contains the image store itself; import a subtree")
        return path

    def _older_than_grace(self, digest: str, now: float) -> bool:
        try:
            return now - self.store.path(digest).stat().st_mtime > ORPHAN_GRACE_SECONDS
        except FileNotFoundError:
            return False


async def _in_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """to_thread whose cancellation waits for the thread: a tree being written must not
    be deleted under the thread that writes it."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await task
        raise


def _stamp_ok(stamp: Path) -> bool:
    try:
        doc = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    ok = isinstance(doc, dict) and doc.get("version") == builders.DEBIAN_RECIPE_VERSION
    return ok and (stamp.parent / "rootfs").is_dir()


@contextlib.asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An flock shared with other processes, polled so that cancellation is clean."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        os.close(fd)
