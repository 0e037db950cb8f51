"""Named, versioned layers: build (directory, tar, git checkout), tag, remove, push, pull.

A workspace or toolkit layer is an EROFS image of just its own files, placed under a
prefix (e.g. /workspace), so it stacks on any base: changing a task repository
rebuilds that one layer, not every image containing it. OCI-style whiteouts in the
input (``.wh.name``, ``.wh..wh..opq``) become overlayfs whiteouts, so a layer can also
delete or hide what the layers below it contain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
from datetime import UTC, datetime
from pathlib import Path

from dsec import spawn
from dsec.api.images import ImageInfo
from dsec.api.layers import BuildLayerRequest, LayerInfo, LayerKind, LayerRef
from dsec.errors import ImageBuildError, ImageNotFound, InvalidArgument, Unsupported
from dsec.images.chunkindex import DEFAULT_CHUNK_SIZE, build_index
from dsec.images.extract import OPAQUE, WHITEOUT, default_config, split_member_name, unpack_archive
from dsec.images.images import Images
from dsec.images.remote.client import RemoteStore
from dsec.images.remote.records import check_name, check_version
from dsec.images.store import sha256_file

log = logging.getLogger(__name__)

OPAQUE_XATTR = "trusted.overlay.opaque"


def parse_tag(ref: str) -> tuple[str, str]:
    name, sep, version = ref.partition(":")
    return check_name(name), check_version(version if sep else "latest")


def convert_whiteouts(tree: Path) -> int:
    """OCI whiteout files -> overlayfs whiteouts (char 0:0 / opaque xattr); returns how
    many were converted. Blocking."""
    converted = 0
    for dirpath, dirs, files in os.walk(tree):
        for name in [*files, *dirs]:
            if not name.startswith(WHITEOUT):
                continue
            path = os.path.join(dirpath, name)
            if name == OPAQUE:
                os.setxattr(dirpath, OPAQUE_XATTR, b"y")
            elif name.startswith(WHITEOUT + WHITEOUT):
                pass  # other AUFS metadata: not content
            else:
                target = name.removeprefix(WHITEOUT)
                if target in ("", ".", ".."):
                    raise InvalidArgument(f"invalid whiteout {path!r}")
                victim = os.path.join(dirpath, target)
                if os.path.lexists(victim):
                    raise InvalidArgument(f"{victim!r} is both present and whited out")
                os.mknod(victim, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            converted += 1
        dirs[:] = [d for d in dirs if not d.startswith(WHITEOUT)]
    return converted


def _has_whiteouts(tree: Path) -> bool:
    for _dirpath, dirs, files in os.walk(tree):
        if any(n.startswith(WHITEOUT) for n in (*dirs, *files)):
            return True
    return False


def _place(rootfs: Path, prefix: str) -> Path:
    """``rootfs/<prefix>`` created with plain 0755 parents."""
    parts = split_member_name(prefix.lstrip("/"), "layer prefix") if prefix != "/" else []
    dest = rootfs
    for part in parts:
        dest = dest / part
        dest.mkdir(mode=0o755, exist_ok=True)
    return dest


class LayerService:
    """Layer operations of one platform, on top of its Images (store + registry)."""

    def __init__(self, images: Images) -> None:
        self.images = images

    # -- queries --

    async def list(self) -> list[LayerInfo]:
        return await self.images.layer_registry.all()

    async def get(self, ref: str) -> LayerInfo:
        name, version = parse_tag(ref)
        info = await self.images.find_layer(LayerRef(name, version))
        if info is None:
            raise ImageNotFound(f"layer {name}:{version} not found", ref=f"{name}:{version}")
        return info

    def cache_report(self) -> dict[str, object]:
        """What the host cache holds and what the lazy loader did (for operators, benches)."""
        host = self.images.host
        entries = host.usage()
        mounted = self.images.mounts.mounted()
        return {
            "budget_bytes": host.cache_bytes,
            "used_bytes": sum(e[1] for e in entries),
            "hits": host.hits,
            "misses": host.misses,
            "layers": [
                {"digest": d, "bytes": b, "last_used": t, "kind": k, "users": mounted.get(d, 0)}
                for d, b, t, k in entries
            ],
            "lazy": self.images.lazy.stats() if self.images.lazy is not None else {},
        }

    # -- build --

    async def build(self, req: BuildLayerRequest) -> LayerInfo:
        name, version = parse_tag(req.ref)
        path = Path(req.path)
        if req.source == "git":
            return await self._build_git(name, version, path, req.rev, req.prefix, req.kind)
        async with self.images.work_dir() as work:
            rootfs = work / "rootfs"
            rootfs.mkdir(mode=0o755)
            if req.source == "dir":
                if not await asyncio.to_thread(path.is_dir):
                    raise InvalidArgument(f"{path} is not a directory on the platform's host")
                if req.prefix == "/" and not await asyncio.to_thread(_has_whiteouts, path):
                    tree = path  # as it is: no copy needed
                else:
                    dest = _place(rootfs, req.prefix)
                    cp = shutil.which("cp") or "/bin/cp"
                    await _run([cp, "-a", f"{path}/.", str(dest)], "copying the directory")
                    tree = rootfs
                source = None
            else:
                if not await asyncio.to_thread(path.is_file):
                    raise InvalidArgument(f"{path} is not a file on the platform's host")
                tar_digest, _ = await asyncio.to_thread(sha256_file, path)
                source = f"tar:{tar_digest}:{req.prefix}:{req.kind}"
                reused = await self._reuse(source, name, version)
                if reused is not None:
                    return reused
                await self._unpack(path, rootfs, req.prefix, work)
                tree = rootfs
            if tree is rootfs:
                await asyncio.to_thread(convert_whiteouts, rootfs)
            return await self._register(name, version, tree, req.kind, source)

    async def _build_git(
        self, name: str, version: str, repo: Path, rev: str | None, prefix: str, kind: LayerKind
    ) -> LayerInfo:
        """``git archive`` of a revision of a checkout on the host (tracked files only)."""
        if not await asyncio.to_thread(repo.is_dir):
            raise InvalidArgument(f"{repo} is not a directory on the platform's host")
        git = shutil.which("git")
        if git is None:
            raise ImageBuildError("git is not installed on the platform's host")
        res = await spawn.run(
            [git, "-C", str(repo), "rev-parse", "--verify", f"{rev or 'HEAD'}^{{commit}}"]
        )
        if res.returncode != 0:
            raise InvalidArgument(
                f"{repo}: not a git checkout or unknown revision {rev or 'HEAD'}: "
                f"{res.stderr.strip()[-300:]}"
            )
        commit = res.stdout.strip()
        source = f"git:{commit}:{prefix}:{kind}"
        reused = await self._reuse(source, name, version)
        if reused is not None:
            return reused
        async with self.images.work_dir() as work:
            archive = work / "checkout.tar"
            await _run(
                [git, "-C", str(repo), "archive", "--format=tar", "-o", str(archive), commit],
                "git archive",
            )
            rootfs = work / "rootfs"
            rootfs.mkdir(mode=0o755)
            await self._unpack(archive, rootfs, prefix, work)
            await asyncio.to_thread(convert_whiteouts, rootfs)
            return await self._register(name, version, rootfs, kind, source)

    async def _unpack(self, archive: Path, rootfs: Path, prefix: str, work: Path) -> None:
        dest = _place(rootfs, prefix)
        await asyncio.to_thread(unpack_archive, archive, dest, fmt="tar", scratch=work)

    async def _reuse(self, source: str, name: str, version: str) -> LayerInfo | None:
        """Same input as an earlier build: tag its layer instead of building again."""
        earlier = await self.images.layer_registry.by_source(source)
        if earlier is None or not self.images.store.exists(earlier.digest):
            return None
        info = earlier.model_copy(
            update={"name": name, "version": version, "created_at": datetime.now(UTC)}
        )
        await self.images.record_layer(info)
        return info

    async def _register(
        self, name: str, version: str, tree: Path, kind: LayerKind, source: str | None
    ) -> LayerInfo:
        async with self.images.built_layer(tree) as digest:
            info = LayerInfo(
                name=name,
                version=version,
                digest=digest,
                size_bytes=self.images.store.size(digest),
                kind=kind,
                config=default_config() if kind == "base" else None,
                source=source,
                created_at=datetime.now(UTC),
            )
            before = await self.images.record_layer(info)
        if before is not None and before.digest != digest:
            await self.images.gc()
        return info

    # -- tags --

    async def tag(self, source: str, target: str) -> LayerInfo:
        name, version = parse_tag(target)
        found = await self._resolve_any(source)
        info = found.model_copy(
            update={"name": name, "version": version, "created_at": datetime.now(UTC)}
        )
        before = await self.images.record_layer(info)
        if before is not None and before.digest != info.digest:
            await self.images.gc()
        return info

    async def remove(self, ref: str) -> LayerInfo:
        name, version = parse_tag(ref)
        info = await self.images.delete_layer_tag(name, version)
        if info is None:
            raise ImageNotFound(f"layer {name}:{version} not found", ref=f"{name}:{version}")
        await self.images.gc()
        if info.digest not in await self.images.layer_registry.referenced():
            self.images.host.forget(info.digest)
        return info

    async def _resolve_any(self, ref: str) -> LayerInfo:
        """A layer tag, a digest, or a single-layer image (which becomes a base layer)."""
        if ref.startswith("sha256:"):
            digest, size = await self.images.layer_digest(LayerRef(ref))
            return LayerInfo(
                name="digest",
                version="digest",
                digest=digest,
                index_digest=self.images.indexes.get(digest),
                size_bytes=size,
                created_at=datetime.now(UTC),
            )
        try:
            name, version = parse_tag(ref)
            layer = await self.images.find_layer(LayerRef(name, version))
        except InvalidArgument:
            layer = None
        if layer is not None:
            return layer
        image = await self.images.resolve(ref)
        return self._image_layer(image)

    def _image_layer(self, image: ImageInfo) -> LayerInfo:
        if len(image.layers) != 1:
            raise Unsupported(
                f"image {image.ref} has {len(image.layers)} layers; only single-layer images "
                "can be used as a base layer"
            )
        return LayerInfo(
            name=image.name.replace("/", "-"),
            version=image.tag,
            digest=image.layers[0],
            index_digest=self.images.indexes.get(image.layers[0]),
            size_bytes=image.size_bytes,
            kind="base",
            config=dict(image.config),
            created_at=image.created_at,
        )

    # -- the shared store --

    def _remote(self) -> RemoteStore:
        if self.images.remote is None:
            raise Unsupported(
                "no shared layer store is configured: start the platform with "
                "--layer-store http://host:port, /shared/path or oci://registry/repo"
            )
        return self.images.remote

    async def push(self, ref: str) -> LayerInfo:
        """Blob, chunk index and reference to the shared store (index built if needed)."""
        remote = self._remote()
        info = await self._resolve_any(ref)
        if ":" in ref and not ref.startswith("sha256:"):
            name, version = parse_tag(ref)
            info = info.model_copy(update={"name": name, "version": version})
        blob = await asyncio.to_thread(self.images.store.verify, info.digest)
        index = await asyncio.to_thread(build_index, blob, DEFAULT_CHUNK_SIZE)
        data = index.to_bytes()
        await self.images.layer_registry.put_index(info.digest, index.digest, index.chunk_size)
        self.images.indexes[info.digest] = index.digest
        info = info.model_copy(update={"index_digest": index.digest})
        await remote.push_blob(info.digest, blob)
        await remote.push_index(info.digest, data)
        await remote.put_ref(info)
        if await self.images.layer_registry.get(info.name, info.version) is not None:
            await self.images.record_layer(info)
        return info

    async def pull(self, ref: str, *, blob: bool = True) -> LayerInfo:
        """Record a reference from the shared store here; with ``blob`` also fetch the
        whole blob now (otherwise sandboxes fetch chunks lazily on first read)."""
        remote = self._remote()
        name, version = parse_tag(ref)
        info = await remote.get_ref(name, version)
        if info is None:
            raise ImageNotFound(f"layer {name}:{version} is not in the shared layer store")
        before = await self.images.record_layer(info)
        if blob:
            await self.images.host.fetch_blob(info.digest)
        if before is not None and before.digest != info.digest:
            await self.images.gc()
        return info


async def _run(argv: list[str], what: str) -> None:
    res = await spawn.run(argv, timeout=3600)
    if res.returncode != 0:
        raise ImageBuildError(f"{what} failed: {res.stderr.strip()[-500:]}", step=what)
