"""One registry layer (a tar, plain, gzip or zstd) -> one overlay-ready tree for mkfs.erofs.

A registry layer keeps its deletions, so it is written the way a packed sandbox diff
is (dsec.images.difftar, shared code): ``.wh.name`` becomes an overlayfs whiteout and
``.wh..wh..opq`` the opaque xattr, and overlayfs applies them against the layers below
when the image is mounted. Registry content is as untrusted as a sandbox's: no path
outside the tree; no device node (left out, and listed with the reason in the pull's
report: a sandbox must never reach a host device through an image); of the archive's
xattrs only file capabilities (``security.capability``) and ``user.*`` are kept, never
``trusted.*`` (overlayfs' own). Hard links to a file of a layer below are copied up
through ``lower`` (dsec.images.oci.lower).

Conversion can run while the blob downloads (``ChunkPipe`` feeds a worker thread from
the event loop): decompression and extraction then overlap the network. The layer's
diff id (SHA-256 of the uncompressed tar) is computed on the way and checked against
the image config; the compressed digest is checked by the download itself before
anything built from it is kept.
"""

from __future__ import annotations

import errno
import gzip
import io
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import zstandard

from dsec.errors import ImageBuildError, InsufficientStorage, InvalidArgument
from dsec.images.difftar import REGISTRY_XATTRS, LowerLookup, write_diff_tree
from dsec.images.extract import CHUNK, HashingReader

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class ConvertedTree:
    diff_id: str  # sha256 of the uncompressed tar
    entries: int
    skipped: list[str]
    lower_links: int
    xattrs: int
    compression: str  # "gzip", "zstd" or "none"
    uncompressed_bytes: int
    seconds: float


class ChunkPipe(io.RawIOBase):
    """Bytes handed over from the event loop to a reading thread, with backpressure.

    The producer calls ``put`` (blocking: run it in a thread) and ``close_write`` (or
    ``fail``); the reader reads like a file. When the reader gives up (``close``), the
    producer's puts are dropped instead of blocking forever.
    """

    def __init__(self, depth: int = 8) -> None:
        self._q: queue.Queue[bytes | BaseException | None] = queue.Queue(depth)
        self._buf = memoryview(b"")  # the rest of the current chunk: never copied whole
        self._eof = False
        self._gone = threading.Event()

    # producer side
    def put(self, chunk: bytes | BaseException | None) -> None:
        while not self._gone.is_set():
            try:
                self._q.put(chunk, timeout=0.2)
                return
            except queue.Full:
                continue

    # reader side
    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._buf and not self._eof:
            item = self._q.get()
            if item is None:
                self._eof = True
            elif isinstance(item, BaseException):
                self._eof = True
                raise item
            else:
                self._buf = memoryview(item)
        n = min(len(buf), len(self._buf))
        buf[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        self._gone.set()
        super().close()


def _decompressor(raw: io.RawIOBase) -> tuple[str, IO[bytes]]:
    reader = io.BufferedReader(raw, CHUNK)
    head = reader.peek(4)[:4]
    if head.startswith(GZIP_MAGIC):
        return "gzip", cast(IO[bytes], gzip.GzipFile(fileobj=reader, mode="rb"))
    if head == ZSTD_MAGIC:
        dctx = zstandard.ZstdDecompressor()
        return "zstd", cast(IO[bytes], dctx.stream_reader(reader, read_size=CHUNK))
    return "none", cast(IO[bytes], reader)


def convert_layer(
    stream: io.RawIOBase, root: Path, *, max_bytes: int, lower: LowerLookup | None = None
) -> ConvertedTree:
    """Decompress and write the layer ``stream`` into the new directory ``root``; the
    stream is read to its end either way. Blocking: run it in a thread."""
    start = time.monotonic()
    try:
        kind, plain = _decompressor(stream)
        hashing = HashingReader(plain)
        tar_stream = io.BufferedReader(hashing, CHUNK)
        try:
            result = write_diff_tree(
                tar_stream,
                root,
                excluded=(),
                max_bytes=max_bytes,
                xattrs=REGISTRY_XATTRS,
                lower=lower,
            )
            while tar_stream.read(CHUNK):  # the tar's end padding counts in the diff id
                pass
            while stream.read(CHUNK):  # and the producer must reach its digest check
                pass
        except (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError) as exc:
            raise ImageBuildError(f"the layer is not a valid {kind} stream: {exc}") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientStorage(
                    f"no space left for the layer's files: {exc.strerror}"
                ) from None
            raise
        except InvalidArgument as exc:
            raise ImageBuildError(f"the layer is malformed: {exc}") from None
        return ConvertedTree(
            diff_id="sha256:" + hashing.hash.hexdigest(),
            entries=result.entries,
            skipped=result.skipped,
            lower_links=result.lower_links,
            xattrs=result.xattrs,
            compression=kind,
            uncompressed_bytes=hashing.size,
            seconds=time.monotonic() - start,
        )
    finally:
        stream.close()  # a producer still sending stops (ChunkPipe drops its puts)
