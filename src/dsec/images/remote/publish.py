"""Put a directory tree into a store directory as a named layer, without a platform.

What ``dsec layer build`` + ``dsec layer push`` do, in one process: used by the
benchmarks and tests to stand in for "another host published this layer".
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from dsec.api.layers import LayerInfo, LayerKind
from dsec.errors import ImageBuildError
from dsec.images.chunkindex import DEFAULT_CHUNK_SIZE, build_index
from dsec.images.remote.dirstore import DirStore


def publish_tree(
    store: DirStore,
    tree: Path,
    name: str,
    version: str,
    *,
    kind: LayerKind = "workspace",
    config: dict[str, object] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LayerInfo:
    """mkfs.erofs ``tree``, store blob + chunk index, and point ``name:version`` at it.

    OCI whiteout files in ``tree`` are turned into overlayfs whiteouts in place."""
    from dsec.images.layers import convert_whiteouts

    convert_whiteouts(tree)
    store.open()
    fd, tmp = tempfile.mkstemp(dir=store.root / "tmp", suffix=".erofs")
    os.close(fd)
    try:
        res = subprocess.run(
            ["mkfs.erofs", "--quiet", "--preserve-mtime", tmp, str(tree)],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise ImageBuildError(f"mkfs.erofs failed: {res.stderr.strip()[-500:]}")
        index = build_index(Path(tmp), chunk_size)
        store.put_blob_file(index.blob_digest, Path(tmp))
        store.put_index(index.blob_digest, index.to_bytes())
    finally:
        os.unlink(tmp)
    info = LayerInfo(
        name=name,
        version=version,
        digest=index.blob_digest,
        index_digest=index.digest,
        size_bytes=index.blob_size,
        kind=kind,
        config=config,
        created_at=datetime.now(UTC),
    )
    store.put_ref(info)
    return info
