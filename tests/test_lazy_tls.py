"""Lazy layer loading from an HTTPS registry with expiring tokens, for real: Debian's
distribution registry serving TLS (a CA made here), a token service whose tokens live
5 s, a platform on ``oci://`` with DSEC_REGISTRY_CA_FILE, sandboxes whose layers
dsec-lazyfs fetches chunk by chunk over verified TLS, reads that continue across token
expiry, and a wrong CA refused by both the Python side and the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, LayerRef, PlatformUnavailable
from dsec.errors import RegistryError
from dsec.images.builders import BUSYBOX_CONFIG, busybox_tree
from dsec.images.lazy.daemon import LazyDaemon
from dsec.images.lazy.renew import renew_delay
from dsec.images.oci.client import RegistryClient, RegistrySettings
from dsec.images.oci.reference import Reference
from dsec.images.remote.client import HTTPStore
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.ocistore import OCIStore
from dsec.images.remote.publish import publish_tree
from dsec.images.store import digest_hex
from tests.conftest import PlatformProcess, platform_process
from tests.oci_registry import Registry, TLSFiles, publish, registry, registry_available
from tests.ports import free_port

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for FUSE and EROFS"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
    pytest.mark.skipif(
        not registry_available(push=False, htpasswd=False),
        reason="needs docker-registry (install.sh)",
    ),
]

REPO = "dsec/tls"
TOKEN_LIFETIME = 5
DATA = 8 << 20


@pytest.fixture(scope="module")
def treg() -> Iterator[Registry]:
    users = {"dsec": secrets.token_hex(8)}
    with registry(token_users=users, token_lifetime=TOKEN_LIFETIME, tls=True) as r:
        yield r


@pytest.fixture(scope="module")
def tls(treg: Registry) -> TLSFiles:
    """The CA, the wrong CA and the server certificate of ``treg``."""
    assert treg.tls is not None
    return treg.tls


@pytest.fixture(scope="module")
def tls_platform(treg: Registry, tls: TLSFiles) -> Iterator[PlatformProcess]:
    with platform_process(
        DSEC_LAYER_STORE=treg.store_url(REPO),
        DSEC_LAYER_STORE_TOKEN=treg.credentials,
        DSEC_REGISTRY_CA_FILE=str(tls.ca),
        DSEC_LAZY_FETCH_TIMEOUT="5",
    ) as plat:
        yield plat


def lazy_root(plat: PlatformProcess) -> Path:
    [state] = list(plat.data_dir.rglob("lazy/daemon.json"))
    return state.parent


def daemon_source(root: Path) -> str:
    """The store the running dsec-lazyfs of ``root`` reads (asserting it runs)."""
    state = json.loads((root / "daemon.json").read_text())
    cmdline = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    assert os.path.basename(cmdline[0]).startswith(b"dsec-lazyfs")
    return str(state["source"])


def layer_fetched(root: Path, digest: str) -> int:
    for line in (root / "fuse" / ".stats").read_text().splitlines():
        parts = line.split()
        if parts[:2] == ["layer", digest_hex(digest)]:
            return int(parts[3])
    return 0


async def test_layers_load_lazily_over_https_across_token_expiry(
    tls_platform: PlatformProcess, treg: Registry, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    busybox_tree(base)
    await publish(treg, REPO, base, "tlsbb", kind="base", config=dict(BUSYBOX_CONFIG))
    ws = tmp_path / "ws"
    (ws / "work").mkdir(parents=True)
    data = os.urandom(DATA)
    (ws / "work" / "data.bin").write_bytes(data)
    info = await publish(treg, REPO, ws, "tlsws")
    client = DSecClient(tls_platform.url, tls_platform.api_key)
    await client.open()
    try:
        args = DSecContainerRunArgs(
            container_image="tlsbb:1",
            workspace=LayerRef("tlsws", "1"),
            image_loading="lazy",
            ttl_running_stop=120,
        )
        async with await client.run_container(args) as sb:
            r = await sb.run_shell("head -c 65536 /work/data.bin | md5sum")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split()[0] == hashlib.md5(data[:65536]).hexdigest()
            root = lazy_root(tls_platform)
            assert daemon_source(root).startswith("https://127.0.0.1:")
            first = layer_fetched(root, info.digest)
            assert 0 < first < DATA // 4, first  # only part of the layer came over TLS
            auth_file = root / "store-auth"
            st = auth_file.stat()
            assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
            assert treg.tokens is not None
            issued = treg.tokens.issued
            # The daemon's token expires; the platform renews the file, the daemon's
            # next read is answered 401, re-reads it and goes on.
            await asyncio.sleep(TOKEN_LIFETIME + 2)
            assert treg.tokens.issued > issued
            r = await sb.run_shell("tail -c 65536 /work/data.bin | md5sum")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split()[0] == hashlib.md5(data[-65536:]).hexdigest()
            assert first < layer_fetched(root, info.digest) < DATA // 2
        cache = await client.layer_cache()
        assert cache["lazy"]["auth_reloads"] >= 1
        assert cache["lazy"]["fetch_errors"] == 0
    finally:
        await client.close()


async def test_wrong_ca_is_refused(treg: Registry, tls: TLSFiles, tmp_path: Path) -> None:
    """A registry whose certificate the configured CA did not sign: a typed error from
    the layer store and the pull client, and EIO (with the reason in its log) from dsec-lazyfs."""
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "f").write_bytes(os.urandom(200_000))
    info = await publish(treg, REPO, tree, "tlsca")
    wrong = OCIStore(treg.store_url(REPO), treg.credentials, ca_file=tls.other_ca)
    try:
        with pytest.raises(PlatformUnavailable, match="TLS certificate is not trusted"):
            await wrong.blob_size(info.digest)
    finally:
        await wrong.close()
    system = OCIStore(treg.store_url(REPO), treg.credentials)  # the system CAs
    try:
        with pytest.raises(PlatformUnavailable, match="DSEC_REGISTRY_CA_FILE"):
            await system.get_ref("tlsca", "1")
    finally:
        await system.close()
    settings = RegistrySettings(ca_file=tls.other_ca)  # what `dsec image pull` uses
    async with RegistryClient(settings) as pull:
        with pytest.raises(RegistryError, match="TLS certificate is not trusted"):
            await pull.image(Reference.parse(f"{treg.host}/{REPO}:any"))
    index = DirStore(tmp_path / "t-store").get_index(info.digest)
    assert index is not None
    await asyncio.to_thread(read_through_daemon, treg, tls, tmp_path / "lazy", info.digest, index)


def read_through_daemon(
    treg: Registry, tls: TLSFiles, root: Path, digest: str, index: bytes
) -> None:
    daemon = LazyDaemon(
        root,
        f"https://{treg.host}/v2/{REPO}",
        None,
        blob_prefix="/blobs/",
        ca_file=tls.other_ca,
        timeout=5,
    )
    daemon.start()
    try:
        layer = daemon.cache_dir / digest_hex(digest)
        layer.mkdir(parents=True)
        (layer / "index").write_bytes(index)
        with open(daemon.path(digest_hex(digest)), "rb") as fh, pytest.raises(OSError) as exc:
            fh.read(4096)
        assert exc.value.errno == errno.EIO
        assert "its certificate is not trusted" in daemon.log_path.read_text()
        assert daemon.stats()["fetch_bytes"] == 0
    finally:
        daemon.stop()


def test_our_store_server_over_https(tls: TLSFiles, tmp_path: Path) -> None:
    """``dsec store serve --tls-cert/--tls-key``: the HTTPS store client and dsec-lazyfs
    verify it with the CA setting and read from it."""
    root = tmp_path / "store"
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "f").write_bytes(os.urandom(300_000))
    info = publish_tree(DirStore(root), tree, "https", "1")
    port = free_port()
    token = "dst_" + secrets.token_hex(8)
    argv = [sys.executable, "-m", "dsec.cli.main", "store", "serve", "--root", str(root)]
    argv += ["--port", str(port), "--token", token]
    argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{port}"
    try:
        verify = tls.context()
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/health", timeout=1, verify=verify).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "no store server"
            time.sleep(0.05)
        store = HTTPStore(url, token, ca_file=tls.ca)
        size = asyncio.run(store.fetch_blob(info.digest, tmp_path / "copy"))
        asyncio.run(store.close())
        assert size == info.size_bytes
        blob = (tmp_path / "copy").read_bytes()
        daemon = LazyDaemon(tmp_path / "lazy", url, token, ca_file=tls.ca, timeout=5)
        daemon.start()
        try:
            index = DirStore(root).get_index(info.digest)
            assert index is not None
            layer = daemon.cache_dir / digest_hex(info.digest)
            layer.mkdir(parents=True)
            (layer / "index").write_bytes(index)
            with open(daemon.path(digest_hex(info.digest)), "rb") as fh:
                fh.seek(65536)
                assert fh.read(4096) == blob[65536 : 65536 + 4096]
            assert 0 < daemon.stats()["fetch_bytes"] < info.size_bytes
        finally:
            daemon.stop()
    finally:
        proc.terminate()
        proc.wait(10)


def test_renewal_runs_at_half_the_remaining_life() -> None:
    assert renew_delay(100.0, 40.0) == 30.0
    assert renew_delay(10.0, 10.0) == 0.5  # expired: renew now, without spinning
