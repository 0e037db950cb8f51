"""Content-addressed layer store: ``<root>/blobs/sha256/<hex>``, one EROFS image each.

A blob's name is the SHA-256 of its bytes, so a blob that no longer hashes to its name
is corrupt by definition and must never be mounted. Hashing a 260 MB layer costs
~0.3 s, too slow for every sandbox start, so a verified blob gets a small marker
(``<root>/verified/sha256/<hex>``) holding its inode, size, mtime and ctime: any write
to the blob changes its ctime and forces a full re-hash before the next mount.

Blobs are written to ``<root>/tmp`` first, fsynced, then hard-linked into place, so
readers never see a partial blob and two writers of the same content cannot clobber
each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from dsec import linux
from dsec.errors import CorruptBlob, ImageBuildError, ImageNotFound, InvalidArgument

log = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
HEX_RE = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


def normalize_digest(digest: str) -> str:
    """``sha256:<hex>`` (a bare 64-digit hex is accepted too); anything else is refused
    so that a digest can never smuggle a path into the store."""
    if HEX_RE.match(digest):
        return f"sha256:{digest}"
    if not DIGEST_RE.match(digest):
        raise InvalidArgument(f"invalid layer digest {digest!r}: expected sha256:<64 hex digits>")
    return digest


def digest_hex(digest: str) -> str:
    return normalize_digest(digest).removeprefix("sha256:")


def sha256_file(path: Path) -> tuple[str, int]:
    """(digest, size) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            h.update(view[:n])
            size += n
    return f"sha256:{h.hexdigest()}", size


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Readers see the old content or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """rmtree that first detaches anything mounted below ``path``: a crashed debootstrap
    can leave /proc or a bind mount of /dev inside its tree, and rmtree must never
    descend into those."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for entry in sorted(linux.mounts(path), key=lambda m: m.mount_point, reverse=True):
        linux.umount(entry.mount_point, detach=True)
    shutil.rmtree(path)


def _signature(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class LayerStore:
    """Blobs on the local disk of this host, addressed by the SHA-256 of their bytes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.verified_dir = self.root / "verified" / "sha256"
        self.tmp_dir = self.root / "tmp"
        # In-process cache of verified signatures; the marker files survive restarts.
        self._verified: dict[str, str] = {}

    def open(self) -> None:
        """Create the directories and drop temp files of processes that no longer run."""
        for d in (self.blobs_dir, self.verified_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        for entry in self.tmp_dir.iterdir():
            pid = entry.name.split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not linux.pid_alive(int(pid)):
                log.info("removing stale temp %s", entry)
                with contextlib.suppress(OSError):
                    remove_tree(entry)

    # -- temp space on the same file system as the blobs (so rename/link work) --

    def temp_path(self, suffix: str = "") -> Path:
        """A fresh name under tmp/, tagged with our pid so a restart can clean it up."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        return self.tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"

    @contextlib.contextmanager
    def temp_dir(self, suffix: str = "") -> Iterator[Path]:
        path = self.temp_path(suffix)
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            remove_tree(path)

    # -- blobs --

    def path(self, digest: str) -> Path:
        """Where a blob lives; unverified, may not exist."""
        return self.blobs_dir / digest_hex(digest)

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            raise ImageNotFound(
                f"layer {normalize_digest(digest)} is not in the layer store at {self.blobs_dir}"
            ) from None

    def digests(self) -> list[str]:
        """Every blob on disk (verified or not)."""
        if not self.blobs_dir.is_dir():
            return []
        return sorted(f"sha256:{p.name}" for p in self.blobs_dir.iterdir() if HEX_RE.match(p.name))

    def add_file(self, src: Path) -> str:
        """Move a finished file into the store under its digest; returns the digest.

        ``src`` must be on the store's file system (use :meth:`temp_path`). It is
        consumed. If the blob already exists and is intact the new copy is dropped;
        a corrupt existing blob is replaced.
        """
        os.chmod(src, 0o444)
        with open(src, "rb") as fh:
            os.fsync(fh.fileno())
        digest, _size = sha256_file(src)
        dest = self.path(digest)
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        consumed = False
        try:
            os.link(src, dest)
        except FileExistsError:
            try:
                self.verify(digest)
            except CorruptBlob:
                log.warning("replacing corrupt blob %s", digest)
                os.replace(src, dest)
                consumed = True
        finally:
            if not consumed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(src)
        fsync_dir(self.blobs_dir)
        # The link/unlink above changed the inode's ctime: mark it verified only now.
        self._mark_verified(digest, dest.stat())
        return digest

    def add_verified(self, src: Path, digest: str) -> None:
        """Link a file whose bytes were just hashed to ``digest`` (while it was
        fetched) into the store without hashing it again; ``src`` is consumed."""
        digest = normalize_digest(digest)
        os.chmod(src, 0o444)
        with open(src, "rb") as fh:
            os.fsync(fh.fileno())
        dest = self.path(digest)
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dest)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(src)
        fsync_dir(self.blobs_dir)
        self._mark_verified(digest, dest.stat())

    def verify(self, digest: str, *, force: bool = False) -> Path:
        """The blob's path once its bytes are known to match its digest.

        Cheap when the blob is unchanged since its last verification (one stat and
        one small read); a full re-hash otherwise or when ``force`` is set. Raises
        ImageNotFound if it is missing and CorruptBlob if it does not match.
        """
        digest = normalize_digest(digest)
        path = self.path(digest)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ImageNotFound(
                f"layer {digest} is not in the layer store at {self.blobs_dir}; "
                "re-import or rebuild the image that uses it"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptBlob(f"layer {digest}: {path} is not a regular file", digest=digest)
        sig = _signature(st)
        if not force:
            if self._verified.get(digest) == sig:
                return path
            marker = self.verified_dir / digest_hex(digest)
            with contextlib.suppress(OSError):
                if marker.read_text() == sig:
                    self._verified[digest] = sig
                    return path
        self._forget(digest)
        actual, size = sha256_file(path)
        if actual != digest:
            raise CorruptBlob(
                f"layer {digest} is corrupt: its {size} bytes hash to {actual}; it will not "
                "be mounted. Remove and re-import or rebuild the image that uses it.",
                digest=digest,
                actual=actual,
                size=size,
            )
        self._mark_verified(digest, path.stat())
        return path

    def delete(self, digest: str) -> None:
        digest = normalize_digest(digest)
        self._forget(digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(digest))

    def _mark_verified(self, digest: str, st: os.stat_result) -> None:
        sig = _signature(st)
        self._verified[digest] = sig
        self.verified_dir.mkdir(parents=True, exist_ok=True)
        # Not fsynced: losing a marker only costs one re-hash.
        write_atomic(self.verified_dir / digest_hex(digest), sig.encode(), durable=False)

    def _forget(self, digest: str) -> None:
        self._verified.pop(digest, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.verified_dir / digest_hex(digest))

    # -- building --

    async def build_erofs(self, tree: Path, *, compression: str | None = None) -> str:
        """mkfs.erofs ``tree`` into a new blob; returns its digest."""
        out = self.temp_path(".erofs")
        await mkfs_erofs(out, tree, compression=compression)
        try:
            return await asyncio.to_thread(self.add_file, out)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out)
            raise


async def mkfs_erofs(
    out: Path, tree: Path, *, compression: str | None = None, exclude: Sequence[str] = ()
) -> None:
    """mkfs.erofs ``tree`` into ``out`` (removed again on any failure).

    Per-file mtimes are kept (``--preserve-mtime``, never ``-T``): Python checks .pyc
    files against their source's mtime and would otherwise recompile its stdlib on
    every start. Ownership, modes, xattrs, device nodes (overlay whiteouts included),
    symlinks and hard links are kept by mkfs.erofs itself when it runs as root.
    ``exclude`` names paths under ``tree`` to leave out.
    """
    args = ["mkfs.erofs", "--quiet", "--preserve-mtime"]
    if compression:
        args.append(f"-z{compression}")
    args += [f"--exclude-path={p.lstrip('/')}" for p in exclude]
    args += [str(out), str(tree)]
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"},
        )
    except FileNotFoundError:
        raise ImageBuildError("mkfs.erofs is not installed (apt-get install erofs-utils)") from None
    try:
        output, _ = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out)
        raise
    if proc.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out)
        tail = output.decode(errors="replace").strip()[-2000:]
        raise ImageBuildError(
            f"mkfs.erofs failed with exit code {proc.returncode}: {tail}", step="mkfs.erofs"
        )
