"""An OCI registry as the layer store, for real: Debian's distribution registry on
loopback with htpasswd auth, a platform configured with ``oci+http://host:port/repo``,
sandboxes whose layers are loaded lazily through Range GETs on the registry's blobs, and
``dsec layer push/pull`` against it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, LayerRef, PlatformUnavailable
from dsec.api.layers import LayerInfo
from dsec.images.builders import BUSYBOX_CONFIG, busybox_tree
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.ocistore import OCIStore
from dsec.images.remote.publish import publish_tree
from tests.conftest import PlatformProcess, platform_process
from tests.oci_registry import Registry, publish, registry, registry_available

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for FUSE and EROFS"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
    pytest.mark.skipif(not registry_available(), reason="needs docker-registry (install.sh)"),
]

REPO = "dsec/layers"


@pytest.fixture(scope="module")
def reg() -> Iterator[Registry]:
    with registry(htpasswd={"dsec": secrets.token_hex(8)}) as r:
        yield r


@pytest.fixture(scope="module")
def oci_platform(reg: Registry) -> Iterator[PlatformProcess]:
    with platform_process(
        DSEC_LAYER_STORE=reg.store_url(REPO),
        DSEC_LAYER_STORE_TOKEN=reg.credentials,
        DSEC_LAZY_FETCH_TIMEOUT="5",
    ) as plat:
        yield plat


async def test_registry_store_round_trip(reg: Registry, tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "big").write_bytes(os.urandom(2 << 20))
    info = await publish(reg, REPO, tree, "rt", "1")
    store = OCIStore(reg.store_url(REPO), reg.credentials)
    try:
        assert await store.blob_size(info.digest) == info.size_bytes
        assert not await store.push_blob(info.digest, tmp_path / "t-store" / "unused")
        got = await store.get_ref("rt", "1")
        assert got is not None and got.digest == info.digest
        assert await store.get_index(info.digest) is not None
        assert "rt:1" in [r.ref for r in await store.refs()]
        n = await store.fetch_blob(info.digest, tmp_path / "copy")
        assert n == info.size_bytes
        # What dsec-lazyfs asks: a Range GET on the blob, with the store's header.
        auth = await store.lazy_authorization()
        assert auth is not None and auth.startswith("Basic ")
        async with httpx.AsyncClient() as http:
            r = await http.get(
                f"{store.url}/blobs/{info.digest}",
                headers={"Range": "bytes=4096-8191", "Authorization": auth},
            )
        assert r.status_code == 206 and len(r.content) == 4096
        assert await store.delete_ref("rt", "1")
        assert await store.get_ref("rt", "1") is None
        assert not await store.delete_ref("rt", "1")
    finally:
        await store.close()
    wrong = OCIStore(reg.store_url(REPO), f"{reg.user}:wrong")
    try:
        with pytest.raises(PlatformUnavailable, match="refused"):
            await wrong.blob_size(info.digest)
    finally:
        await wrong.close()


async def test_registry_with_a_token_service(tmp_path: Path) -> None:
    """Bearer tokens, as Docker Hub and most private registries do: the registry's
    challenge sends the store to the token service, with the basic credentials there;
    the token it gets is what dsec-lazyfs would send for its range reads."""
    with registry(token_users={"dsec": secrets.token_hex(8)}) as reg:
        assert reg.tokens is not None
        tree = tmp_path / "t"
        (tree / "d").mkdir(parents=True)
        (tree / "d" / "f").write_bytes(os.urandom(300_000))
        staging = DirStore(tmp_path / "staging")
        info = publish_tree(staging, tree, "tok", "1")
        store = OCIStore(reg.store_url(REPO), reg.credentials)
        try:
            # A cached token that falls short (pull only) is refused on the push: the
            # 401 is answered with a fresh token and the upload sent again.
            reg.tokens.grant = ["pull"]
            assert await store.blob_size(info.digest) is None
            issued = reg.tokens.issued
            reg.tokens.grant = None
            assert await store.push_blob(info.digest, staging.blob_path(info.digest))
            assert reg.tokens.issued == issued + 1
            index = staging.get_index(info.digest)
            assert index is not None
            await store.push_index(info.digest, index)
            await store.put_ref(info)
            got = await store.get_ref("tok", "1")
            assert got is not None and got.digest == info.digest
            assert await store.fetch_blob(info.digest, tmp_path / "copy") == info.size_bytes
            auth = await store.lazy_authorization()
            assert auth is not None and auth.startswith("Bearer ")
            async with httpx.AsyncClient() as http:
                r = await http.get(
                    f"{store.url}/blobs/{info.digest}",
                    headers={"Range": "bytes=0-4095", "Authorization": auth},
                )
            assert r.status_code == 206 and len(r.content) == 4096
            assert reg.tokens.issued >= 1
        finally:
            await store.close()
        anonymous = OCIStore(reg.store_url(REPO), None)
        try:
            with pytest.raises(PlatformUnavailable, match="token service"):
                await anonymous.blob_size(info.digest)
        finally:
            await anonymous.close()


async def test_sandbox_layers_lazily_loaded_from_the_registry(
    oci_platform: PlatformProcess, reg: Registry, tmp_path: Path
) -> None:
    base_tree = tmp_path / "base"
    base_tree.mkdir()
    busybox_tree(base_tree)
    (base_tree / "etc" / "motd").write_text("base\n")
    await publish(reg, REPO, base_tree, "regbb", "1", kind="base", config=dict(BUSYBOX_CONFIG))
    ws_tree = tmp_path / "ws"
    (ws_tree / "work").mkdir(parents=True)
    (ws_tree / "work" / "data.bin").write_bytes(os.urandom(1 << 20))
    (ws_tree / "etc").mkdir()
    (ws_tree / "etc" / "motd").write_text("workspace\n")
    await publish(reg, REPO, ws_tree, "regws", "1")
    client = DSecClient(oci_platform.url, oci_platform.api_key)
    await client.open()
    try:
        for loading in ("lazy", "eager"):
            args = DSecContainerRunArgs(
                container_image="regbb:1",
                workspace=LayerRef("regws", "1"),
                image_loading=loading,
                ttl_running_stop=120,
            )
            async with await client.run_container(args) as sb:
                r = await sb.run_shell("cat /etc/motd; wc -c < /work/data.bin")
                assert r.exit_code == 0, r.stderr
                assert r.stdout.split() == ["workspace", str(1 << 20)], loading
        cache = await client.layer_cache()
        assert cache["lazy"]["fetch_bytes"] > 0
        assert cache["lazy"]["fetch_errors"] == 0
    finally:
        await client.close()


def test_layer_push_pull_cli(oci_platform: PlatformProcess, reg: Registry, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("hi\n")
    env = dict(os.environ, DSEC_URL=oci_platform.url, DSEC_API_KEY=oci_platform.api_key)

    def dsec(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dsec.cli.main", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    built = dsec("layer", "build", "cliws:1", "--dir", str(src), "--prefix", "/w")
    assert built.returncode == 0, built.stderr
    pushed = dsec("layer", "push", "cliws:1", "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert dsec("layer", "rm", "cliws:1").returncode == 0

    async def in_registry() -> LayerInfo | None:
        store = OCIStore(reg.store_url(REPO), reg.credentials)
        try:
            return await store.get_ref("cliws", "1")
        finally:
            await store.close()

    remote = asyncio.run(in_registry())
    assert remote is not None and remote.index_digest is not None
    pulled = dsec("layer", "pull", "cliws:1", "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert remote.digest in pulled.stdout
    missing = dsec("layer", "pull", "nope:1")
    assert missing.returncode == 1 and "not in the shared layer store" in missing.stderr
    assert dsec("layer", "rm", "cliws:1").returncode == 0
