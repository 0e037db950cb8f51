"""The host chunk cache: per layer ``<cache>/<hex>/{index,data,present,last_used}``.

It lives on disk so it survives restarts (the daemon re-verifies a cached chunk the
first time it serves it again). Its size is the allocated blocks of the sparse data
files; the least recently used layers that no sandbox uses are removed when the cache
is over its budget (dsec.images.hostlayers decides, this module only keeps books).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dsec.images.store import HEX_RE, digest_hex, write_atomic


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    bytes: int
    last_used: float


class LazyCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))

    def layer_dir(self, digest: str) -> Path:
        return self.root / digest_hex(digest)

    def has_index(self, digest: str) -> bool:
        return (self.layer_dir(digest) / "index").is_file()

    def install_index(self, digest: str, data: bytes) -> None:
        """Write a verified index: from now on the daemon serves the layer."""
        d = self.layer_dir(digest)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "index", data, mode=0o600, durable=False)
        self.touch(digest)

    def touch(self, digest: str) -> None:
        stamp = self.layer_dir(digest) / "last_used"
        with contextlib.suppress(FileNotFoundError):
            stamp.touch()

    def entries(self) -> list[CacheEntry]:
        out: list[CacheEntry] = []
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            if not HEX_RE.match(d.name):
                continue
            used = 0
            for name in ("data", "present", "index"):
                with contextlib.suppress(FileNotFoundError):
                    used += os.stat(d / name).st_blocks * 512
            try:
                last = os.stat(d / "last_used").st_mtime
            except FileNotFoundError:
                last = 0.0
            out.append(CacheEntry(f"sha256:{d.name}", used, last))
        return out

    def cached_bytes(self, digest: str) -> int:
        try:
            return os.stat(self.layer_dir(digest) / "data").st_blocks * 512
        except FileNotFoundError:
            return 0

    def remove(self, digest: str) -> None:
        shutil.rmtree(self.layer_dir(digest), ignore_errors=True)
