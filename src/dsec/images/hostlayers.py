"""Where a layer's bytes come from on this host, and the bounded host cache.

A layer is mounted from, in order of preference:
1. its verified blob in the local store (built here, pushed here, or fetched eagerly);
2. with ``image_loading="lazy"``: a file on the dsec-lazyfs FUSE mount, whose chunks
   are fetched from the shared store on first read. Only the verified chunk index has
   to be local before the sandbox starts, so start time does not grow with the image;
3. with ``"eager"`` (or when lazy loading cannot be trusted, e.g. a bare digest with
   no known index): the whole blob is fetched first and verified against its digest.

Concurrent sandboxes needing the same missing layer share one fetch. The cache (lazy
chunk caches and eagerly fetched blobs) is kept under ``cache_bytes``: the least
recently used layers that no sandbox has mounted are dropped; a layer in use never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from dsec.api.layers import ImageLoading
from dsec.errors import CorruptBlob, ImageNotFound
from dsec.images.chunkindex import ChunkIndex
from dsec.images.lazy.cache import LazyCache
from dsec.images.lazy.daemon import LazyDaemon
from dsec.images.mounts import LayerMounts
from dsec.images.remote.client import RemoteStore
from dsec.images.service import LayersWanted
from dsec.images.store import LayerStore, digest_hex, normalize_digest

log = logging.getLogger(__name__)

# A prepared layer a sandbox has not mounted within this long (its create failed) may
# be evicted again.
PIN_SECONDS = 120.0


class HostLayers:
    def __init__(
        self,
        store: LayerStore,
        *,
        remote: RemoteStore | None = None,
        daemon: LazyDaemon | None = None,
        cache_bytes: int = 20 << 30,
        index_of: Callable[[str], str | None] = lambda _digest: None,
    ) -> None:
        self.store = store
        self.remote = remote
        self.daemon = daemon
        self.cache = LazyCache(daemon.cache_dir) if daemon is not None else None
        self.cache_bytes = cache_bytes
        self.index_of = index_of
        self.fetched_dir = store.root / "fetched" / "sha256"
        self.mounts: LayerMounts | None = None
        # Told which in-use layers the budget wants back (LayerCacheBudget).
        self.wanted_listeners: list[LayersWanted] = []
        self._over_budget = False
        self._lazy: set[str] = set()
        # Prepared for a sandbox that has not mounted it yet: not evictable meanwhile.
        self._pinned: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Future[None]] = {}
        # Layers asked for by prepare(): found on this host, or fetched (whole, or
        # their chunk index when lazy); cumulative, read by cache reports and metrics.
        self.hits = 0
        self.misses = 0

    # -- what LayerMounts mounts --

    def source(self, digest: str) -> Path:
        """The file to mount EROFS from (a verified local blob or a lazy FUSE file)."""
        digest = normalize_digest(digest)
        if digest in self._lazy and self.daemon is not None:
            return self.daemon.path(digest_hex(digest))
        return self.store.verify(digest)

    def is_lazy(self, digest: str) -> bool:
        return normalize_digest(digest) in self._lazy

    def keep_mount(self, digest: str, source: str) -> bool:
        """After a restart: may an existing EROFS mount of ``digest`` be adopted?"""
        if self.daemon is not None and source.startswith(str(self.daemon.mount_dir) + "/"):
            if self.daemon.alive() and self.cache is not None and self.cache.has_index(digest):
                self._lazy.add(normalize_digest(digest))
                return True
            return False
        return self.store.exists(digest)

    # -- getting a layer ready --

    async def prepare(self, digests: list[str], loading: str) -> None:
        """Make every layer mountable (concurrently; one fetch per layer host-wide)."""
        mode: ImageLoading = "eager" if loading == "eager" else "lazy"
        await asyncio.gather(*(self._prepare_one(normalize_digest(d), mode) for d in digests))

    def acquired(self, digest: str) -> None:
        """A sandbox mounted it: its refcount protects it from now on."""
        self._pinned.pop(normalize_digest(digest), None)

    async def _prepare_one(self, digest: str, loading: ImageLoading) -> None:
        self._pinned[digest] = time.monotonic()
        if digest in self._lazy or self.store.exists(digest):
            self.hits += 1
            if self.cache is not None:
                self.cache.touch(digest)
            return
        self.misses += 1
        if self.remote is None:
            raise ImageNotFound(
                f"layer {digest} is not in the local layer store and no shared layer store "
                "is configured (dsec up --layer-store URL|PATH)"
            )
        key = f"{loading}:{digest}"
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._materialize(digest, loading))
            self._inflight[key] = task
            task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        await asyncio.shield(task)

    async def _materialize(self, digest: str, loading: ImageLoading) -> None:
        assert self.remote is not None
        index_digest = self.index_of(digest)
        if loading == "lazy" and self.daemon is not None and index_digest is not None:
            await self._attach_lazy(digest, index_digest)
        else:
            if loading == "lazy" and index_digest is None:
                log.info("layer %s has no known chunk index: loading it eagerly", digest)
            await self.fetch_blob(digest)
        await asyncio.to_thread(self.enforce_budget)

    async def _attach_lazy(self, digest: str, index_digest: str) -> None:
        assert self.remote is not None and self.cache is not None and self.daemon is not None
        if not self.cache.has_index(digest):
            data = await self.remote.get_index(digest)
            if data is None:
                raise ImageNotFound(f"the layer store has no chunk index for {digest}")
            ChunkIndex.from_bytes(data, blob_digest=digest, index_digest=index_digest)
            await asyncio.to_thread(self.cache.install_index, digest, data)
        self._lazy.add(digest)

    async def fetch_blob(self, digest: str) -> None:
        """Fetch the whole blob into the local store (verified) - eager loading."""
        assert self.remote is not None
        digest = normalize_digest(digest)
        if self.store.exists(digest):
            return
        tmp = self.store.temp_path(".fetch")
        try:
            await self.remote.fetch_blob(digest, tmp)
            await asyncio.to_thread(self.store.add_verified, tmp, digest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.fetched_dir.mkdir(parents=True, exist_ok=True)
        (self.fetched_dir / digest_hex(digest)).touch()

    # -- the bounded cache --

    def usage(self) -> list[tuple[str, int, float, str]]:
        """(digest, bytes, last used, kind) of everything in the host cache."""
        out: list[tuple[str, int, float, str]] = []
        if self.cache is not None:
            out += [(e.digest, e.bytes, e.last_used, "lazy") for e in self.cache.entries()]
        if self.fetched_dir.is_dir():
            for marker in self.fetched_dir.iterdir():
                digest = f"sha256:{marker.name}"
                try:
                    size = self.store.path(digest).stat().st_blocks * 512
                except FileNotFoundError:
                    marker.unlink(missing_ok=True)
                    continue
                out.append((digest, size, marker.stat().st_mtime, "blob"))
        return out

    @property
    def over_budget(self) -> bool:
        return self._over_budget

    def enforce_budget(self) -> list[str]:
        """Drop least recently used cached layers no sandbox uses until under budget."""
        entries = sorted(self.usage(), key=lambda e: e[2])
        total = sum(e[1] for e in entries)
        evicted: list[str] = []
        held: dict[str, int] = {}  # in use, with how many users
        now = time.monotonic()
        for digest, size, _last, kind in entries:
            if total <= self.cache_bytes:
                break
            if now - self._pinned.get(digest, -PIN_SECONDS) < PIN_SECONDS:
                continue  # about to be mounted
            if self.mounts is not None:
                users = self.mounts.refcount(digest)
                if users > 0:
                    held[normalize_digest(digest)] = users
                    continue  # in use: never evicted
                if not self.mounts.unmount(digest):
                    continue
            if kind == "lazy":
                if self.cache is not None:
                    self.cache.remove(digest)
                self._lazy.discard(normalize_digest(digest))
            else:
                self.store.delete(digest)
                (self.fetched_dir / digest_hex(digest)).unlink(missing_ok=True)
            total -= size
            evicted.append(digest)
        if evicted:
            log.info("host layer cache over budget: evicted %d layers", len(evicted))
        self._over_budget = total > self.cache_bytes
        if held and self._over_budget:
            # Still over: holders that can let go (warm sandboxes) are asked to; the
            # release of the last user calls this again, which evicts then.
            for listener in list(self.wanted_listeners):
                listener(dict(held))
        return evicted

    def forget(self, digest: str) -> None:
        """A layer was deleted from the registry: drop its cache if unused."""
        digest = normalize_digest(digest)
        if self.mounts is not None and self.mounts.refcount(digest) > 0:
            return
        if self.cache is not None:
            self.cache.remove(digest)
        self._lazy.discard(digest)

    def check_index(self, digest: str, index_digest: str) -> None:
        """Verify a cached index against the registry (CorruptBlob if it changed)."""
        if self.cache is None:
            return
        path = self.cache.layer_dir(digest) / "index"
        with contextlib.suppress(FileNotFoundError):
            try:
                ChunkIndex.from_bytes(path.read_bytes(), index_digest=index_digest)
            except CorruptBlob:
                path.unlink()
                raise
