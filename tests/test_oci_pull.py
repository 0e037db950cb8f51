"""dsec image pull against a real registry (Debian's docker-registry, filled by skopeo).

One module platform (plain HTTP allowed for the test registries only), one open
registry and one with htpasswd basic auth. The images are built here: a busybox base
(gzip), a layer deleting a file of the base and making a directory opaque (zstd), an
arm64 twin in a multi-arch index, and a second image sharing the base.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient
from dsec.api.fields import parse_image_ref
from dsec.control.db import make_engine, sqlite_url
from dsec.errors import BackendError, CorruptBlob, ImageNotFound, InvalidArgument, RegistryError
from dsec.images.images import Images
from dsec.images.oci.auth import Credentials, load_docker_config, parse_challenge
from dsec.images.oci.blobcheck import BlobCheck
from dsec.images.oci.client import RegistrySettings
from dsec.images.oci.lower import LowerLayers
from dsec.images.oci.reference import Reference, names_registry
from dsec.images.remote.client import open_remote
from dsec.sdk.dockerfile import build_dockerfile
from tests.conftest import PlatformProcess, platform_process
from tests.oci_registry import (
    CAP_NET_RAW_V2,
    Layout,
    Registry,
    busybox_base,
    fidelity_tar,
    layer_tar,
    registry,
    registry_available,
)

pytestmark = pytest.mark.root

USER, PASSWORD = "alice", "s3cret-pw"
MIRRORED = "registry.invalid"  # a registry name that never resolves (RFC 2606)


# -- no registry needed --


def test_references() -> None:
    r = Reference.parse("127.0.0.1:5000/team/task:v1")
    assert (r.registry, r.repository, r.tag, r.digest) == (
        "127.0.0.1:5000",
        "team/task",
        "v1",
        None,
    )
    r = Reference.parse("busybox")
    assert (r.registry, r.repository, r.tag) == ("docker.io", "library/busybox", "latest")
    digest = "sha256:" + "a" * 64
    r = Reference.parse(f"ghcr.io/x/y@{digest}")
    assert (r.tag, r.digest, r.reference) == (None, digest, digest)
    # local names keep resolving locally and are never pulled implicitly
    assert parse_image_ref("busybox:latest") == ("busybox", "latest")
    assert parse_image_ref("debian-python:bookworm") == ("debian-python", "bookworm")
    assert parse_image_ref(f"reg.io/x@{digest}") == ("reg.io/x", "sha256-" + "a" * 64)
    assert not names_registry("busybox:latest")
    assert not names_registry("debian-python:bookworm")
    assert names_registry("localhost:5000/x") and names_registry(f"x@{digest}")
    for bad in ("Busybox", "a:b:c", "/x", "x@sha256:zz"):
        with pytest.raises(InvalidArgument):
            Reference.parse(bad)


class CountedMounts:
    """LayerMounts' refcounts, no mounts: prepare waits like a lazy layer's index fetch."""

    def __init__(self) -> None:
        self.refs: dict[str, int] = {}

    async def prepare(self, digests: list[str], loading: str = "lazy") -> None:
        await asyncio.sleep(0.2)

    def acquire(self, digest: str) -> Path:
        self.refs[digest] = self.refs.get(digest, 0) + 1
        return Path("/nonexistent") / digest

    def release(self, digest: str) -> None:
        self.refs[digest] -= 1


async def test_lower_layers_closed_under_a_running_lookup_hold_no_layer() -> None:
    """An abandoned conversion's thread may still look up while the caller closes the
    lower layers (a thread cannot be cancelled): it must not mount a layer after close
    (nobody would release it: a layer mount left at shutdown), and close must release
    exactly what was acquired."""
    mounts = CountedMounts()
    loop = asyncio.get_running_loop()
    lower = LowerLayers(mounts, ["sha256:a", "sha256:b"], loop)  # type: ignore[arg-type]
    assert await asyncio.to_thread(lower.lookup, ["etc", "x"]) is None  # both looked at
    assert mounts.refs == {"sha256:a": 1, "sha256:b": 1}
    await asyncio.to_thread(lower.close)
    assert mounts.refs == {"sha256:a": 0, "sha256:b": 0}

    racing = LowerLayers(mounts, ["sha256:c"], loop)  # type: ignore[arg-type]
    lookup = asyncio.ensure_future(asyncio.to_thread(racing.lookup, ["etc", "x"]))
    await asyncio.sleep(0.05)  # the lookup waits for the layer's prepare
    await asyncio.to_thread(racing.close)
    with pytest.raises(BackendError, match="abandoned"):
        await lookup
    assert mounts.refs.get("sha256:c", 0) == 0
    with pytest.raises(BackendError):
        await asyncio.to_thread(racing.lookup, ["etc", "x"])


def test_blob_check() -> None:
    data = b"layer bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    ok = BlobCheck(digest, len(data))
    ok.update(data[:5])
    ok.update(data[5:])
    assert ok.matches() and ok.actual == digest
    short = BlobCheck(digest, len(data) + 1)
    short.update(data)
    assert not short.matches()  # truncated
    with pytest.raises(CorruptBlob, match="larger than announced"):
        BlobCheck(digest, 4, "the layer").update(data)
    wrong = BlobCheck(digest)
    wrong.update(b"other bytes")
    assert not wrong.matches()


def test_challenge_and_docker_config(tmp_path: Path) -> None:
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.example/token",
        "service": "reg",
        "scope": "repository:a/b:pull",
    }
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"u:p").decode()},
                    "reg.example:5000": {"username": "v", "password": "q"},
                },
                "credsStore": "never-run",
            }
        )
    )
    assert load_docker_config(cfg) == {
        "docker.io": Credentials("u", "p"),
        "reg.example:5000": Credentials("v", "q"),
    }
    assert load_docker_config(tmp_path / "missing.json") == {}


# -- against the registries --


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """``multi`` (an amd64 + arm64 index) and ``second`` (shares the base); every
    registry test needs it, so the registry tests skip here (the others still run)."""
    if not registry_available():
        pytest.skip("needs docker-registry, skopeo and openssl (install.sh), and crypt")
    layout = Layout(tmp_path_factory.mktemp("oci") / "layout")
    base = busybox_base({"etc/old.txt": b"old\n", "opq/a.txt": b"a\n", "opq/b.txt": b"b\n"})
    top = layer_tar(
        {
            "etc/old.txt": None,  # deletes a file of the base
            "opq": "opaque",  # hides the base's opq/*
            "opq/c.txt": b"c\n",
            "hello.txt": b"hello from the registry\n",
        }
    )
    config: dict[str, object] = {
        "Env": ["PATH=/bin:/sbin", "GREETING=hi"],
        "WorkingDir": "/opq",
        "Cmd": ["sh"],
    }
    # the one image run with a non-root USER (its layers are the same as without)
    amd64 = layout.image([(base, "gzip"), (top, "zstd")], {**config, "User": "1000:1000"})
    arm64 = layout.image(
        [(base, "gzip"), (layer_tar({"arch.txt": b"arm64\n"}), "gzip")], config, arch="arm64"
    )
    layout.tag("multi", [amd64, arm64])
    second = layout.image([(base, "gzip"), (layer_tar({"second.txt": b"2\n"}), "gzip")], config)
    layout.tag("second", [second])
    # Layer fidelity: the same top layer (caps, devices, hard links to the base's file)
    # on two bases whose linked file differs.
    fidelity = fidelity_tar("etc/lowerfile.txt")
    for tag, text in (("fidelity", b"from base one\n"), ("fidelity2", b"from base two\n")):
        fbase = busybox_base({"etc/lowerfile.txt": text})
        fcfg = {
            **config,
            "WorkingDir": "/",
            "Labels": {"team": "rl", "bad": 7},  # a non-string value is not kept
            "ExposedPorts": {"8080/tcp": {}},
            "StopSignal": "SIGINT",
            "Shell": ["/bin/sh", "-ec"],
            "Healthcheck": {"Test": ["CMD", "true"], "Interval": 30 * 10**9, "Retries": -1},
        }
        layout.tag(tag, [layout.image([(fbase, "gzip"), (fidelity, "gzip")], fcfg)])
    unique = layer_tar({"unique.txt": b"only in this image\n" * 4096})
    layout.tag("corrupt", [layout.image([(base, "gzip"), (unique, "gzip")], config)])
    return layout


@pytest.fixture(scope="module")
def open_registry(layout: Layout) -> Iterator[Registry]:
    with registry() as reg:
        reg.push(layout.path, "multi", "test/multi:v1")
        reg.push(layout.path, "second", "test/second:v1")
        reg.push(layout.path, "second", "test/oncreate:v1")
        reg.push(layout.path, "corrupt", "test/corrupt:v1")
        reg.push(layout.path, "second", "test/dfbase:v1")
        reg.push(layout.path, "fidelity", "test/fidelity:v1")
        reg.push(layout.path, "fidelity2", "test/fidelity2:v1")
        yield reg


@pytest.fixture(scope="module")
def auth_registry(layout: Layout) -> Iterator[Registry]:
    with registry(htpasswd={USER: PASSWORD}) as reg:
        reg.push(layout.path, "second", "private/img:v1", creds=f"{USER}:{PASSWORD}")
        yield reg


@pytest.fixture(scope="module")
def token_registry(layout: Layout) -> Iterator[Registry]:
    with registry(token_users={USER: PASSWORD}) as reg:
        reg.push(layout.path, "second", "private/tok:v1", creds=f"{USER}:{PASSWORD}")
        yield reg


@pytest.fixture(scope="module")
def plat(
    open_registry: Registry,
    auth_registry: Registry,
    token_registry: Registry,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PlatformProcess]:
    """The platform: plain HTTP for the test registries only, the token registry's
    credentials in a Docker config.json, and a mirror for a registry that does not exist."""
    insecure = (
        f"{open_registry.host},localhost:{open_registry.port},"
        f"{auth_registry.host},{token_registry.host}"
    )
    auth_file = tmp_path_factory.mktemp("regauth") / "config.json"
    login = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    auth_file.write_text(json.dumps({"auths": {token_registry.host: {"auth": login}}}))
    with platform_process(
        DSEC_INSECURE_REGISTRIES=insecure,
        DSEC_REGISTRY_AUTH_FILE=str(auth_file),
        DSEC_REGISTRY_MIRRORS=f"{MIRRORED}=http://{open_registry.host}",
    ) as p:
        yield p


def _run(client: DSecSyncClient, image: str, script: str) -> str:
    sb = client.run_container(
        DSecContainerRunArgs(container_image=image, memory_limit_mb=256), timeout=120
    )
    try:
        r = sb.run_shell(script)
        assert r.exit_code == 0, r.stderr
        return r.stdout
    finally:
        sb.stop()


def test_pull_multiarch_whiteouts_and_run(plat: PlatformProcess, open_registry: Registry) -> None:
    ref = f"{open_registry.host}/test/multi:v1"
    with DSecSyncClient(plat.url, plat.api_key) as client:
        result = client.pull_image(ref)
        assert [layer.reused for layer in result.layers] == [False, False]
        assert result.image.ref == ref and len(result.image.layers) == 2
        assert result.bytes_fetched > 0
        out = _run(
            client,
            ref,
            "cat /hello.txt; echo $GREETING; ls /opq; "
            "test -e /etc/old.txt && echo present || echo deleted; "
            "test -e /arch.txt && echo arm || echo amd64; pwd; id -u",
        )
        # the image config's Env, WorkingDir and User apply to the sandbox's commands
        assert out == "hello from the registry\nhi\nc.txt\ndeleted\namd64\n/opq\n1000\n"
        # the same pull again converts and fetches no layer
        again = client.pull_image(ref)
        assert all(layer.reused for layer in again.layers)
        assert again.image.layers == result.image.layers


def _layer_xattrs(plat: PlatformProcess, digest: str, paths: list[str]) -> list[dict[str, bytes]]:
    """The xattrs of ``paths`` in our EROFS layer ``digest``, read from a read-only
    loop mount of its blob (unmounted again; the loop device goes with it)."""
    found = plat.data_dir.rglob(digest.removeprefix("sha256:"))
    blob = next(p for p in found if p.parent.parent.name == "blobs")
    with tempfile.TemporaryDirectory(prefix="dsec-fidelity-") as tmp:
        mnt = Path(tmp)
        subprocess.run(["mount", "-t", "erofs", "-o", "ro,loop", str(blob), tmp], check=True)
        try:
            return [{n: os.getxattr(mnt / p, n) for n in os.listxattr(mnt / p)} for p in paths]
        finally:
            subprocess.run(["umount", tmp], check=True)


def test_layer_fidelity_caps_devices_lower_hard_links(
    plat: PlatformProcess, open_registry: Registry
) -> None:
    """File capabilities kept (v3 stored as v2), other archive xattrs only ``user.*``,
    device nodes left out and reported, hard links to the base's file copied up; the
    layer is keyed by its chain id, so the same layer on another base is converted
    again and links that base's file."""
    with DSecSyncClient(plat.url, plat.api_key) as client:
        one = client.pull_image(f"{open_registry.host}/test/fidelity:v1")
        cfg = one.image.config
        assert cfg["labels"] == {"team": "rl"} and cfg["exposed_ports"] == ["8080/tcp"]
        assert cfg["stop_signal"] == "SIGINT" and cfg["shell"] == ["/bin/sh", "-ec"]
        assert cfg["healthcheck"] == {"test": ["CMD", "true"], "interval": 30.0}
        top = one.layers[1]
        assert top.lower_links == 1
        assert sorted(top.left_out) == [
            "dev/mem2 (character device: not part of a layer)",
            "dev/sda9 (block device: not part of a layer)",
        ]
        out = _run(
            client,
            one.image.ref,
            "cat /bin/linked /bin/linked2 /etc/lowerfile.txt; ls /dev/mem2 /dev/sda9 2>&1 | wc -l;"
            " [ $(stat -c %i /bin/linked) = $(stat -c %i /bin/linked2) ] && echo same-inode",
        )
        assert out.splitlines() == ["from base one"] * 3 + ["2", "same-inode"]
        xattrs = _layer_xattrs(plat, top.digest, ["bin/pingish", "bin/pingv3"])
        for found in xattrs:
            assert found == {"security.capability": CAP_NET_RAW_V2, "user.note": b"kept"}
        two = client.pull_image(f"{open_registry.host}/test/fidelity2:v1")
        assert two.layers[1].diff_id == top.diff_id and not two.layers[1].reused
        assert two.layers[1].digest != top.digest
        out = _run(client, two.image.ref, "cat /bin/linked")
        assert out == "from base two\n"
        again = client.pull_image(f"{open_registry.host}/test/fidelity:v1")
        assert [layer.reused for layer in again.layers] == [True, True]  # by chain id
        assert again.image.layers == one.image.layers


def test_second_image_shares_the_base(plat: PlatformProcess, open_registry: Registry) -> None:
    with DSecSyncClient(plat.url, plat.api_key) as client:
        first = client.pull_image(f"{open_registry.host}/test/multi:v1")
        second = client.pull_image(f"{open_registry.host}/test/second:v1", streaming=False)
        assert [layer.reused for layer in second.layers] == [True, False]
        assert second.image.layers[0] == first.image.layers[0]  # one EROFS base, shared
        base_blob = first.layers[0].fetched_bytes or second.layers[0].erofs_bytes
        assert second.bytes_fetched < base_blob


def test_run_spec_naming_a_registry_pulls_on_first_create(
    plat: PlatformProcess, open_registry: Registry
) -> None:
    ref = f"{open_registry.host}/test/oncreate:v1"
    with DSecSyncClient(plat.url, plat.api_key) as client:
        assert _run(client, ref, "cat /second.txt") == "2\n"
        assert client.get_image(ref).ref == ref
        # a plain local name is never pulled implicitly
        with pytest.raises(ImageNotFound):
            client.run_container(DSecContainerRunArgs(container_image="nosuch:latest"))


async def test_dockerfile_from_a_registry_reference(
    plat: PlatformProcess, open_registry: Registry, tmp_path: Path
) -> None:
    """``FROM localhost:PORT/repo:tag`` of an image not on the platform: the build pulls
    it, inherits its config (Env, WorkingDir), runs a RUN and a COPY on it, and the
    result runs."""
    base_ref = f"localhost:{open_registry.port}/test/dfbase:v1"
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base_ref}\n"
        "COPY hello.txt ./hello.txt\n"
        'RUN echo "$GREETING from $(pwd)" > made.txt && cat /second.txt >> made.txt\n'
    )
    async with DSecClient(plat.url, plat.api_key) as client:
        built = await build_dockerfile(client, tmp_path / "Dockerfile", tmp_path, "dffrom:1")
        try:
            base = await client.get_image(base_ref)  # pulled by the build
            assert built.layer_steps == 2
            assert built.image.layers[: len(base.layers)] == base.layers
            assert built.image.config["workdir"] == "/opq"
            args = DSecContainerRunArgs(container_image="dffrom:1", ttl_running_stop=120)
            async with await client.run_container(args) as sb:
                r = await sb.run_shell("pwd; cat made.txt hello.txt; echo $GREETING")
                assert r.stdout.splitlines() == [
                    "/opq",
                    "hi from /opq",
                    "2",
                    "hello from the context",
                    "hi",
                ], r.stderr
        finally:
            await client.remove_image("dffrom:1")


def test_basic_auth(plat: PlatformProcess, auth_registry: Registry) -> None:
    ref = f"{auth_registry.host}/private/img:v1"
    with DSecSyncClient(plat.url, plat.api_key) as client:
        with pytest.raises(RegistryError, match="user name and password"):
            client.pull_image(ref)
        with pytest.raises(RegistryError, match="denied"):
            client.pull_image(ref, username=USER, password="wrong")
        result = client.pull_image(ref, username=USER, password=PASSWORD)
        assert len(result.image.layers) == 2


def test_plain_http_only_when_named(plat: PlatformProcess) -> None:
    # Not in DSEC_INSECURE_REGISTRIES: https is tried and fails, never plain HTTP.
    with (
        registry() as other,
        DSecSyncClient(plat.url, plat.api_key) as client,
        pytest.raises(RegistryError, match="unreachable"),
    ):
        client.pull_image(f"{other.host}/x/y:v1")


def test_bearer_token_auth(plat: PlatformProcess, token_registry: Registry) -> None:
    """The registry's own token auth: a 401 challenge names our token server, which
    trades the basic credentials for a signed JWT."""
    assert token_registry.tokens is not None
    ref = f"{token_registry.host}/private/tok:v1"
    with DSecSyncClient(plat.url, plat.api_key) as client:
        # credentials given to the pull win over the platform's credentials file
        with pytest.raises(RegistryError, match="refused the credentials"):
            client.pull_image(ref, username=USER, password="wrong")
        issued = token_registry.tokens.issued
        result = client.pull_image(ref)  # the platform's config.json has them
        assert len(result.image.layers) == 2
        assert token_registry.tokens.issued > issued


def test_mirror_is_tried_first(plat: PlatformProcess) -> None:
    """``MIRRORED`` does not resolve; its mirror (the open registry) serves the image."""
    with DSecSyncClient(plat.url, plat.api_key) as client:
        result = client.pull_image(f"{MIRRORED}/test/second:v1")
        assert result.image.name == f"{MIRRORED}/test/second"


async def test_converted_once_per_cluster(tmp_path: Path, open_registry: Registry) -> None:
    """Two hosts sharing a layer store: the first converts and publishes each layer,
    the second finds them by diff id and downloads only the manifest and config."""
    settings = RegistrySettings(insecure=frozenset({open_registry.host}))
    results = []
    for host in ("a", "b"):
        engine = make_engine(sqlite_url(tmp_path / f"{host}.sqlite"))
        imgs = Images(
            tmp_path / host,
            engine,
            remote=open_remote(str(tmp_path / "shared")),
            registries=settings,
        )
        try:
            await imgs.open()
            results.append(await imgs.pull(f"{open_registry.host}/test/second:v1"))
        finally:
            await imgs.close()
            await engine.dispose()
    first, second = results
    assert not any(layer.reused for layer in first.layers)
    assert all(layer.reused for layer in second.layers)
    assert second.image.layers == first.image.layers
    assert second.bytes_fetched < 8192 < first.bytes_fetched


def test_corrupt_blob_is_refused(
    plat: PlatformProcess, open_registry: Registry, layout: Layout
) -> None:
    """A registry serving a layer whose bytes do not hash to its digest: the pull fails
    with CorruptBlob and no image is registered."""
    index = json.loads((layout.path / "index.json").read_text())
    entry = next(
        m for m in index["manifests"]
        if m["annotations"]["org.opencontainers.image.ref.name"] == "corrupt"
    )  # fmt: skip
    blobs = layout.path / "blobs" / "sha256"
    manifest = json.loads((blobs / entry["digest"].removeprefix("sha256:")).read_bytes())
    hexdigest = manifest["layers"][1]["digest"].removeprefix("sha256:")
    stored = (
        open_registry.root / "data/docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest
    ) / "data"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    ref = f"{open_registry.host}/test/corrupt:v1"
    with DSecSyncClient(plat.url, plat.api_key) as client:
        with pytest.raises(CorruptBlob):
            client.pull_image(ref)
        with pytest.raises(ImageNotFound):
            client.get_image(ref)


def test_cli_pull_with_password_stdin(plat: PlatformProcess, auth_registry: Registry) -> None:
    env = {**os.environ, "DSEC_URL": plat.url, "DSEC_API_KEY": plat.api_key}
    ref = f"{auth_registry.host}/private/img:v1"
    res = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "image", "pull", ref, "-u", USER,
         "--password-stdin", "--json"],
        input=PASSWORD + "\n", capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["image"]["name"] == f"{auth_registry.host}/private/img"
    assert len(doc["layers"]) == 2


async def test_concurrent_pulls_convert_a_shared_base_once(
    tmp_path: Path, open_registry: Registry
) -> None:
    engine = make_engine(sqlite_url(tmp_path / "c.sqlite"))
    settings = RegistrySettings(insecure=frozenset({open_registry.host}))
    imgs = Images(tmp_path / "images", engine, registries=settings)
    try:
        await imgs.open()
        multi, second = await asyncio.gather(
            imgs.pull(f"{open_registry.host}/test/multi:v1"),
            imgs.pull(f"{open_registry.host}/test/second:v1"),
        )
    finally:
        await imgs.close()
        await engine.dispose()
    assert multi.image.layers[0] == second.image.layers[0]
    assert sorted([multi.layers[0].reused, second.layers[0].reused]) == [False, True]
