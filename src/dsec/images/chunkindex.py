"""The chunk index of a layer blob: one SHA-256 per fixed-size chunk.

Lazy loading fetches a blob chunk by chunk; the blob's own digest can only be checked
once every byte is there, so each chunk is checked against its entry here before it is
served. The index is tiny (32 bytes per chunk: 512 KiB for 1 GiB at 64 KiB chunks),
shipped beside the blob in the store, and is itself content-addressed: the registry
records its digest next to the blob's, so a tampered index is refused before use.

Binary layout (little-endian), read as is by the C loader (dsec-lazyfs.c)::

    "DSECIDX1" | u32 version=1 | u32 chunk_size | u64 blob_size | u64 nchunks
    | 32-byte blob SHA-256 | nchunks x 32-byte chunk SHA-256
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from io import RawIOBase
from pathlib import Path

from dsec.errors import CorruptBlob
from dsec.images.store import digest_hex, normalize_digest

MAGIC = b"DSECIDX1"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ32s")
# Small enough that fetching whole chunks stays close to the bytes actually read (a
# file's two partial edge chunks cost ~64 KiB per file read), large enough that the
# index stays ~0.05% of the blob. Measured: bench/bench_lazy.py, README "Layers".
DEFAULT_CHUNK_SIZE = 64 * 1024
READ_SIZE = 1 << 20


@dataclass(frozen=True)
class ChunkIndex:
    chunk_size: int
    blob_size: int
    blob_digest: str
    digests: bytes  # nchunks * 32

    @property
    def nchunks(self) -> int:
        return len(self.digests) // 32

    def to_bytes(self) -> bytes:
        head = HEADER.pack(
            MAGIC,
            VERSION,
            self.chunk_size,
            self.blob_size,
            self.nchunks,
            bytes.fromhex(digest_hex(self.blob_digest)),
        )
        return head + self.digests

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.to_bytes()).hexdigest()

    def chunk_digest(self, n: int) -> bytes:
        return self.digests[32 * n : 32 * n + 32]

    def check_chunk(self, n: int, data: bytes | memoryview) -> bool:
        return hashlib.sha256(data).digest() == self.chunk_digest(n)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, blob_digest: str | None = None, index_digest: str | None = None
    ) -> ChunkIndex:
        """Parse and check an index; CorruptBlob if it is malformed or not the expected one."""
        what = f"chunk index of {blob_digest}" if blob_digest else "chunk index"
        if index_digest is not None:
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if actual != normalize_digest(index_digest):
                raise CorruptBlob(
                    f"{what} hashes to {actual}, not {index_digest}; it will not be used",
                    digest=index_digest,
                    actual=actual,
                )
        if len(data) < HEADER.size:
            raise CorruptBlob(f"{what} is truncated ({len(data)} bytes)")
        magic, version, chunk, size, nchunks, blob = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise CorruptBlob(f"{what} is not a dsec chunk index (version {VERSION})")
        if chunk <= 0 or chunk % 4096 or nchunks != -(-size // chunk):
            raise CorruptBlob(f"{what} has an inconsistent header")
        if len(data) != HEADER.size + 32 * nchunks:
            raise CorruptBlob(f"{what} is truncated or has trailing bytes")
        found = "sha256:" + blob.hex()
        if blob_digest is not None and found != normalize_digest(blob_digest):
            raise CorruptBlob(f"{what} describes {found} instead")
        return cls(chunk, size, found, bytes(data[HEADER.size :]))


def build_index(path: Path, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChunkIndex:
    """Hash a blob whole and per chunk in one pass (blocking: run it in a thread)."""
    if chunk_size <= 0 or chunk_size % 4096 or READ_SIZE % chunk_size:
        raise ValueError(f"chunk size {chunk_size} must be a multiple of 4096 dividing 1 MiB")
    whole = hashlib.sha256()
    parts: list[bytes] = []
    size = 0
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        assert isinstance(fh, RawIOBase)
        while n := _read_full(fh, view):
            data = view[:n]
            whole.update(data)
            for off in range(0, n, chunk_size):
                parts.append(hashlib.sha256(data[off : off + chunk_size]).digest())
            size += n
    return ChunkIndex(chunk_size, size, "sha256:" + whole.hexdigest(), b"".join(parts))


def _read_full(fh: RawIOBase, view: memoryview) -> int:
    """Fill ``view`` unless the file ends first, so chunks never straddle two reads."""
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            break
        got += n
    return got
