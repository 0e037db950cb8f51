"""A layer store in a directory: the local default, any shared file system, and what
``dsec store serve`` serves over HTTP.

Layout (the same everywhere, so a directory written by one is read by the others)::

    blobs/sha256/<hex>          EROFS layer blobs, named by their SHA-256
    indexes/sha256/<hex>        the chunk index of blob <hex> (dsec.images.chunkindex)
    refs/<name>/<version>.json  layer references (LayerRecord), written atomically

Blobs are written under ``tmp/`` and renamed into place only after their digest
checked out, so a reader on another host never sees a partial or wrong blob under a
real name. Methods block: callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from dsec.errors import CorruptBlob, ImageNotFound, InvalidArgument
from dsec.images.chunkindex import ChunkIndex
from dsec.images.remote.records import LayerRecord, check_name, check_version
from dsec.images.store import HEX_RE, digest_hex, fsync_dir, normalize_digest, write_atomic

COPY = 1 << 20


class DirStore:
    """Content-addressed blobs, their indexes and named refs below ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))

    def __repr__(self) -> str:
        return f"DirStore({str(self.root)!r})"

    def open(self) -> None:
        for sub in ("blobs/sha256", "indexes/sha256", "refs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # -- paths --

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest_hex(digest)

    def index_path(self, digest: str) -> Path:
        return self.root / "indexes" / "sha256" / digest_hex(digest)

    def ref_path(self, name: str, version: str) -> Path:
        return self.root / "refs" / check_name(name) / f"{check_version(version)}.json"

    # -- blobs --

    def blob_size(self, digest: str) -> int | None:
        try:
            return self.blob_path(digest).stat().st_size
        except FileNotFoundError:
            return None

    def blobs(self) -> list[str]:
        d = self.root / "blobs" / "sha256"
        return sorted(f"sha256:{p.name}" for p in d.iterdir() if HEX_RE.match(p.name))

    def open_blob(self, digest: str) -> BinaryIO:
        try:
            return open(self.blob_path(digest), "rb")
        except FileNotFoundError:
            raise ImageNotFound(f"layer {normalize_digest(digest)} is not in {self}") from None

    def put_blob(self, digest: str, chunks: Iterable[bytes]) -> bool:
        """Store a blob from ``chunks`` if it is not there yet; True if it was written.

        The bytes must hash to ``digest`` (InvalidArgument otherwise, nothing kept).
        """
        writer = self.blob_writer(digest)
        try:
            for chunk in chunks:
                writer.write(chunk)
            return writer.commit()
        finally:
            writer.abort()

    def blob_writer(self, digest: str) -> BlobWriter:
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        return BlobWriter(self.blob_path(digest), tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex}")

    def put_blob_file(self, digest: str, src: Path) -> bool:
        with open(src, "rb") as fh:
            return self.put_blob(digest, iter(lambda: fh.read(COPY), b""))

    def delete_blob(self, digest: str) -> bool:
        existed = False
        for path in (self.blob_path(digest), self.index_path(digest)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                existed = True
        return existed

    # -- indexes --

    def get_index(self, digest: str) -> bytes | None:
        try:
            return self.index_path(digest).read_bytes()
        except FileNotFoundError:
            return None

    def put_index(self, digest: str, data: bytes) -> None:
        """Store the chunk index of a blob (InvalidArgument if it is not one for it)."""
        try:
            ChunkIndex.from_bytes(data, blob_digest=digest)
        except CorruptBlob as exc:
            raise InvalidArgument(f"not a valid chunk index: {exc.message}") from None
        path = self.index_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    # -- refs --

    def get_ref(self, name: str, version: str) -> LayerRecord | None:
        try:
            return LayerRecord.model_validate_json(self.ref_path(name, version).read_bytes())
        except FileNotFoundError:
            return None

    def put_ref(self, record: LayerRecord) -> None:
        path = self.ref_path(record.name, record.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, record.model_dump_json().encode())

    def delete_ref(self, name: str, version: str) -> bool:
        path = self.ref_path(name, version)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        return True

    def refs(self) -> list[LayerRecord]:
        out: list[LayerRecord] = []
        base = self.root / "refs"
        if not base.is_dir():
            return out
        for path in sorted(base.rglob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(LayerRecord.model_validate_json(path.read_bytes()))
        return out

    @contextlib.contextmanager
    def _temp(self) -> Iterator[Path]:
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        path = tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def copy_into(store: DirStore, digest: str, src: Path) -> None:
    """Hard-link or copy a verified local blob into ``store`` (same digest, no re-hash
    when it can be linked)."""
    dest = store.blob_path(digest)
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        with store._temp() as tmp:
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o444)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, dest)
    fsync_dir(dest.parent)


class BlobWriter:
    """Receives a blob in pieces into a temp file; :meth:`commit` checks the digest and
    renames it into place. Blocking; :meth:`abort` (idempotent) drops the temp file."""

    def __init__(self, dest: Path, tmp: Path) -> None:
        self.dest = dest
        self.tmp = tmp
        self.digest = "sha256:" + dest.name
        self.size = 0
        self._hash = hashlib.sha256()
        self._fh: BinaryIO | None = open(tmp, "wb")  # noqa: SIM115 - closed by commit/abort

    def write(self, data: bytes) -> None:
        assert self._fh is not None
        self._hash.update(data)
        self._fh.write(data)
        self.size += len(data)

    def commit(self) -> bool:
        """True if the blob was added, False if the store already had it."""
        assert self._fh is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        actual = f"sha256:{self._hash.hexdigest()}"
        if actual != self.digest:
            raise InvalidArgument(
                f"upload of {self.digest} does not match its digest: its {self.size} bytes "
                f"hash to {actual}",
                digest=self.digest,
                actual=actual,
            )
        if self.dest.is_file():
            return False
        os.chmod(self.tmp, 0o444)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.tmp, self.dest)
        except FileExistsError:
            return False
        fsync_dir(self.dest.parent)
        return True

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()
