"""What TLS costs dsec-lazyfs: cold chunk reads from ``dsec store serve`` over plain
HTTP (the baseline) and over HTTPS (verified with a CA made here), in one run.

One random layer is published into one store directory, served twice (``http://`` and
``https://``, same data); a dsec-lazyfs per server exposes it. Each sample is a 64 KiB
pread of a chunk neither daemon has fetched yet (one Range GET, what a sandbox's
random first read costs), with kernel readahead off (POSIX_FADV_RANDOM); the two
daemons alternate read by read, so host noise falls on both. Workers keep their
connection alive, so the TLS handshake is paid once per worker, as in production.

    .venv/bin/python bench/bench_lazytls.py [--layer-mib 64] [--reads 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.oci_registry import make_ca, make_server_cert  # noqa: E402
from tests.ports import free_port  # noqa: E402

from bench.stats import summary  # noqa: E402
from dsec.images.lazy.daemon import LazyDaemon  # noqa: E402
from dsec.images.remote.dirstore import DirStore  # noqa: E402
from dsec.images.remote.publish import publish_tree  # noqa: E402
from dsec.images.store import digest_hex  # noqa: E402

CHUNK = 64 << 10
TOKEN = "dst_bench_" + secrets.token_hex(8)


@contextlib.contextmanager
def store_server(root: Path, tls: tuple[Path, Path] | None, ca: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "dsec.cli.main", "store", "serve", "--root", str(root)]
    argv += ["--port", str(port), "--token", TOKEN]
    if tls is not None:
        argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        verify = ssl.create_default_context(cafile=str(ca))
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/health", timeout=1, verify=verify).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("store server did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def daemon(
    root: Path, url: str, ca: Path, digest: str, index: bytes, stats: dict[str, Any]
) -> Iterator[int]:
    """A dsec-lazyfs on ``url`` exposing the layer; yields an fd open on it (and leaves
    its counters in ``stats``)."""
    d = LazyDaemon(root, url, TOKEN, ca_file=ca, timeout=10)
    d.start()
    try:
        layer = d.cache_dir / digest_hex(digest)
        layer.mkdir(parents=True)
        (layer / "index").write_bytes(index)
        fd = os.open(d.path(digest_hex(digest)), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            yield fd
        finally:
            os.close(fd)
            stats.update(d.stats())
    finally:
        d.stop()


def run(work: Path, mib: int, reads: int) -> dict[str, Any]:
    ca = make_ca(work, "ca")
    tls = make_server_cert(work, ca)
    tree = work / "tree"
    tree.mkdir()
    with open(tree / "data.bin", "wb") as fh:
        for _ in range(mib):
            fh.write(os.urandom(1 << 20))
    store = DirStore(work / "store")
    info = publish_tree(store, tree, "bench", "1")
    index = store.get_index(info.digest)
    assert index is not None
    chunks = info.size_bytes // CHUNK
    picks = random.sample(range(chunks), min(chunks, 2 * reads))
    samples: dict[str, list[float]] = {"http": [], "https": []}
    stats: dict[str, dict[str, Any]] = {"http": {}, "https": {}}
    with (
        store_server(store.root, None, ca[0]) as plain_url,
        store_server(store.root, tls, ca[0]) as tls_url,
        daemon(work / "lazy-http", plain_url, ca[0], info.digest, index, stats["http"]) as plain_fd,
        daemon(work / "lazy-https", tls_url, ca[0], info.digest, index, stats["https"]) as tls_fd,
    ):
        for i, chunk in enumerate(picks):
            name, fd = ("http", plain_fd) if i % 2 == 0 else ("https", tls_fd)
            t0 = time.perf_counter()
            data = os.pread(fd, CHUNK, chunk * CHUNK)
            samples[name].append(time.perf_counter() - t0)
            assert len(data) == CHUNK
    return {
        "layer_mib": mib,
        "loadavg": os.getloadavg(),
        "cold_64k_read": {name: summary(s) for name, s in samples.items()},
        "daemon": {
            name: {k: st.get(k) for k in ("fetch_requests", "fetch_bytes", "fetch_errors")}
            for name, st in stats.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer-mib", type=int, default=64)
    ap.add_argument("--reads", type=int, default=200)
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsec-blt-", dir="/var/tmp"))
    try:
        print(json.dumps(run(work, opts.layer_mib, opts.reads), indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
