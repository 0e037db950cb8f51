"""``dsec image pull``: a registry image -> our image, one EROFS layer per registry layer.

Each registry layer is keyed by its diff id (the digest of its uncompressed tar, which
the image config lists): the EROFS layer built from it is recorded in the layer
registry as ``oci:sha256-<diff id hex>``, so a second image sharing a base converts and
downloads nothing for those layers and shares their EROFS blobs and page cache. With a
shared layer store the converted layer is published there (blob, chunk index, record)
and every other host finds it by the same name and loads it lazily: converted once
per cluster.

A layer that hard-links a file of a layer below it (legal in OCI) depends on those
layers too: it is converted with the file copied up (dsec.images.oci.lower) and
recorded under its *chain id* (the OCI digest of the layer stack up to it) instead of
its diff id, so it is shared only by images with the same stack below.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.api.images import PullLayerReport, PullResult
from dsec.api.layers import LayerInfo, LayerRef
from dsec.errors import CorruptBlob, DSecError, ImageNotFound, RegistryError
from dsec.images.extract import image_config
from dsec.images.oci.auth import Credentials
from dsec.images.oci.client import Descriptor, RegistryClient, RegistrySettings
from dsec.images.oci.convert import ChunkPipe, ConvertedTree, convert_layer
from dsec.images.oci.lower import LowerLayers
from dsec.images.oci.reference import Reference
from dsec.images.registry import NewLayer

if TYPE_CHECKING:
    from dsec.images.images import Images

log = logging.getLogger(__name__)

LAYER_NAME = "oci"  # layer registry name of converted registry layers
DEFAULT_MAX_LAYER_BYTES = 64 << 30  # uncompressed data of one layer
PIPE_BATCH = 4 << 20  # bytes handed to the converter thread at once
MAX_LEFT_OUT = 100  # entries named in a layer report's left_out


@dataclass(frozen=True)
class _Below:
    """What lies under a layer being pulled: its chain id and our layers below it."""

    chain: str
    digests: list[str]


def layer_version(diff_id: str) -> str:
    return "sha256-" + diff_id.removeprefix("sha256:")


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI chain ids: ``chain(0) = diff(0)``, ``chain(n) = sha256(chain(n-1) + " " + diff(n))``."""
    out: list[str] = []
    for diff in diff_ids:
        if not out:
            out.append(diff)
        else:
            out.append("sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return out


def _diff_ids(config: dict[str, Any], count: int, ref: Reference) -> list[str]:
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or len(ids) != count:
        raise RegistryError(
            f"{ref}: the image config lists {len(ids) if isinstance(ids, list) else 'no'} "
            f"diff ids for {count} layers"
        )
    for diff in ids:
        Descriptor.of({"digest": diff, "size": 0}, f"{ref} diff id")
    return [str(d) for d in ids]


class Puller:
    """Pulls for one Images (one host); stateless between pulls."""

    def __init__(
        self,
        images: Images,
        settings: RegistrySettings,
        *,
        max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
    ) -> None:
        self.images = images
        self.settings = settings
        self.max_layer_bytes = max_layer_bytes
        # One conversion per diff id at a time: two images pulled at once that share a
        # base convert it once (the second finds the first's layer).
        self._converting: dict[str, asyncio.Lock] = {}

    async def pull(
        self,
        ref: str,
        name: str,
        tag: str,
        *,
        credentials: Credentials | None = None,
        streaming: bool = True,
    ) -> PullResult:
        start = time.monotonic()
        parsed = Reference.parse(ref)
        creds = {parsed.registry: credentials} if credentials is not None else None
        async with RegistryClient(self.settings, creds) as client:
            manifest = await client.image(parsed)
            config = await client.config(parsed, manifest.config)
            diff_ids = _diff_ids(config, len(manifest.layers), parsed)
            reports: list[PullLayerReport] = []
            held: list[str] = []
            try:
                chains = chain_ids(diff_ids)
                for desc, diff_id, chain in zip(manifest.layers, diff_ids, chains, strict=True):
                    below = [r.digest for r in reports]
                    report = await self._layer(
                        client, parsed, desc, diff_id, streaming, _Below(chain, below)
                    )
                    self.images.hold(report.digest)
                    held.append(report.digest)
                    reports.append(report)
                layers = [
                    NewLayer(
                        digest=r.digest,
                        size_bytes=r.erofs_bytes,
                        source=f"oci:{r.diff_id}",
                    )
                    for r in reports
                ]
                info = await self.images.commit(name, tag, layers, image_config(config))
            finally:
                for digest in held:
                    self.images.release(digest)
            fetched = client.bytes_fetched
        log.info(
            "pulled %s: %d layers (%d reused), %d bytes fetched in %.1fs",
            parsed,
            len(reports),
            sum(r.reused for r in reports),
            fetched,
            time.monotonic() - start,
        )
        return PullResult(
            image=info,
            source=str(parsed),
            manifest_digest=manifest.digest,
            layers=reports,
            bytes_fetched=fetched,
            seconds=time.monotonic() - start,
        )

    async def _known(self, diff_id: str, chain: str) -> LayerInfo | None:
        """The EROFS layer converted from this diff id (or, for a layer that needed
        files of the layers below, this chain id), here or in the shared store."""
        info = await self._find(diff_id)
        if info is None and chain != diff_id:
            info = await self._find(chain)
        return info

    async def _find(self, diff_id: str) -> LayerInfo | None:
        try:
            info = await self.images.find_layer(LayerRef(LAYER_NAME, layer_version(diff_id)))
        except DSecError as exc:  # an unreachable shared store: convert here instead
            log.warning("layer store lookup of %s failed: %s", diff_id, exc)
            return None
        if info is None:
            return None
        try:
            await self.images.layer_digest(LayerRef(info.digest))
        except ImageNotFound:
            return None  # the record outlived its blob: convert again
        return info

    async def _layer(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        diff_id: str,
        streaming: bool,
        below: _Below,
    ) -> PullLayerReport:
        lock = self._converting.setdefault(diff_id, asyncio.Lock())
        try:
            async with lock:
                return await self._layer_locked(client, ref, desc, diff_id, streaming, below)
        finally:
            if not lock.locked():
                self._converting.pop(diff_id, None)

    async def _layer_locked(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        diff_id: str,
        streaming: bool,
        below: _Below,
    ) -> PullLayerReport:
        known = await self._known(diff_id, below.chain)
        if known is not None:
            return PullLayerReport(
                blob=desc.digest,
                diff_id=diff_id,
                digest=known.digest,
                reused=True,
                fetched_bytes=0,
                uncompressed_bytes=0,
                erofs_bytes=known.size_bytes,
                convert_seconds=0.0,
            )
        async with self.images.temp_dir() as work:
            tree = work / "tree"
            before = client.bytes_fetched
            start = time.monotonic()
            lower = LowerLayers(self.images.mounts, below.digests, asyncio.get_running_loop())
            try:
                if streaming:
                    converted = await self._convert_streaming(client, ref, desc, tree, lower)
                else:
                    converted = await self._convert_after_download(
                        client, ref, desc, tree, work, lower
                    )
            finally:
                await asyncio.to_thread(lower.close)
            if converted.diff_id != diff_id:
                raise CorruptBlob(
                    f"layer {desc.digest} of {ref} unpacks to {converted.diff_id}, but the "
                    f"image config says {diff_id}",
                    digest=diff_id,
                    actual=converted.diff_id,
                )
            digest = await self.images.build_layer(tree)
            try:
                seconds = time.monotonic() - start
                keyed = below.chain if converted.lower_links else diff_id
                info = LayerInfo(
                    name=LAYER_NAME,
                    version=layer_version(keyed),
                    digest=digest,
                    size_bytes=self.images.store.size(digest),
                    kind="base",
                    source=f"oci:{diff_id}",
                    created_at=datetime.now(UTC),
                )
                await self.images.record_layer(info)
                try:
                    await self.images.publish_layer(info)
                except (DSecError, OSError) as exc:  # the image works here regardless
                    log.warning("layer %s not published to the layer store: %s", digest, exc)
            finally:
                self.images.release(digest)
        if converted.skipped:
            log.warning(
                "layer %s of %s: left out %d entries (device nodes and the like): %s",
                desc.digest,
                ref,
                len(converted.skipped),
                ", ".join(converted.skipped[:5]),
            )
        return PullLayerReport(
            blob=desc.digest,
            diff_id=diff_id,
            digest=digest,
            reused=False,
            fetched_bytes=client.bytes_fetched - before,
            uncompressed_bytes=converted.uncompressed_bytes,
            erofs_bytes=info.size_bytes,
            convert_seconds=seconds,
            left_out=converted.skipped[:MAX_LEFT_OUT],
            lower_links=converted.lower_links,
        )

    async def _convert_streaming(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        tree: Path,
        lower: LowerLayers,
    ) -> ConvertedTree:
        """Download and convert at once: the event loop feeds a ChunkPipe, a thread
        decompresses and writes the tree. The tree is only used after the download's
        digest check passed (the producer raising fails the whole layer)."""
        pipe = ChunkPipe()
        consumer = asyncio.ensure_future(
            asyncio.to_thread(
                convert_layer, pipe, tree, max_bytes=self.max_layer_bytes, lower=lower.lookup
            )
        )
        try:
            try:
                batch = bytearray()
                async for chunk in client.blob(ref, desc):
                    if pipe.closed:
                        break  # the converter failed; its error is the one to report
                    batch += chunk
                    if len(batch) >= PIPE_BATCH:  # one thread hop per MiBs, not per read
                        await asyncio.to_thread(pipe.put, bytes(batch))
                        batch.clear()
                if batch and not pipe.closed:
                    await asyncio.to_thread(pipe.put, bytes(batch))
            except BaseException as exc:
                await asyncio.to_thread(pipe.put, exc if isinstance(exc, Exception) else None)
                raise
            await asyncio.to_thread(pipe.put, None)
            return await asyncio.shield(consumer)
        except BaseException:
            pipe.close()
            with contextlib.suppress(BaseException):
                await consumer  # the thread writes into tree: wait before it is removed
            raise

    async def _convert_after_download(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        tree: Path,
        work: Path,
        lower: LowerLayers,
    ) -> ConvertedTree:
        """Download the whole blob (digest checked), then convert it."""
        blob = work / "blob"
        fh = await asyncio.to_thread(open, blob, "wb")
        try:
            async for chunk in client.blob(ref, desc):
                await asyncio.to_thread(fh.write, chunk)
        finally:
            await asyncio.to_thread(fh.close)
        src = await asyncio.to_thread(open, blob, "rb", buffering=0)
        return await asyncio.to_thread(
            convert_layer, src, tree, max_bytes=self.max_layer_bytes, lower=lower.lookup
        )
