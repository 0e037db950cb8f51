"""Composable layers and lazy loading, for real: `dsec store serve` on loopback, a
platform configured with it, the dsec-lazyfs FUSE daemon and EROFS mounted on its files.

Layers are published straight into the store directory (as another host's
`dsec layer push` would), so the platform under test only ever sees them remotely.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import CorruptBlob, DSecClient, DSecContainerRunArgs, LayerRef, Unsupported
from dsec.api.layers import LayerInfo
from dsec.images.builders import BUSYBOX_CONFIG, busybox_tree
from dsec.images.chunkindex import ChunkIndex, build_index
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.publish import publish_tree
from tests.conftest import PlatformProcess, platform_process
from tests.ports import free_port

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for FUSE and EROFS"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
]

TOKEN = "dst_test_" + secrets.token_hex(8)


class StoreServer:
    """`dsec store serve` in a subprocess; stop()/start() keep the same port and data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "dsec.cli.main", "store", "serve", "--root"]
        argv += [str(self.root), "--port", str(self.port), "--token", TOKEN]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError("store server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="module")
def store() -> Iterator[StoreServer]:
    root = Path(tempfile.mkdtemp(prefix="dsec-store-", dir="/tmp"))
    server = StoreServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def lazy_platform(store: StoreServer) -> Iterator[PlatformProcess]:
    # A 1 MiB cache budget: every unused layer is evicted at once, used ones never.
    # Warm sandboxes on (dsec.edge.warmpool): they must give layers back to the budget.
    with platform_process(
        DSEC_LAYER_STORE=store.url,
        DSEC_LAYER_STORE_TOKEN=TOKEN,
        DSEC_LAZY_FETCH_TIMEOUT="2",
        DSEC_LAYER_CACHE_BYTES=str(1 << 20),
        DSEC_WARM_POOL="1",
    ) as plat:
        yield plat


@pytest.fixture(scope="module")
def base(store: StoreServer, tmp_path_factory: pytest.TempPathFactory) -> LayerInfo:
    tree = tmp_path_factory.mktemp("base")
    busybox_tree(tree)
    _write(tree / "etc/motd", b"base\n")
    for name in ("a", "b"):
        _write(tree / "data" / name, f"{name} from base\n".encode())
    _write(tree / "opt/x/old", b"old\n")
    return publish_tree(
        DirStore(store.root), tree, "bb", "1", kind="base", config=dict(BUSYBOX_CONFIG)
    )


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _publish(
    store: StoreServer, tmp: Path, name: str, version: str, files: dict[str, bytes]
) -> LayerInfo:
    tree = tmp / f"{name}-{version}-{secrets.token_hex(4)}"
    tree.mkdir()
    for rel, data in files.items():
        _write(tree / rel, data)
    return publish_tree(DirStore(store.root), tree, name, version)


async def _client(plat: PlatformProcess) -> DSecClient:
    client = DSecClient(plat.url, plat.api_key)
    await client.open()
    return client


# -- tests ---------------------------------------------------------------------------


async def test_composition_order_and_whiteouts(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    ws = _publish(
        store,
        tmp_path,
        "ws",
        "1",
        {
            "etc/motd": b"workspace\n",
            "data/.wh.a": b"",  # hides /data/a of the base
            "opt/x/.wh..wh..opq": b"",  # /opt/x of the base becomes invisible
            "opt/x/new": b"new\n",
            "workspace/repo.txt": b"repo\n",
        },
    )
    tk = _publish(store, tmp_path, "tk", "1", {"etc/motd": b"toolkit\n", "tools/grade": b"g\n"})
    client = await _client(lazy_platform)
    try:
        for loading in ("lazy", "eager"):
            args = DSecContainerRunArgs(
                container_image="bb:1",
                workspace=LayerRef("ws", "1"),
                toolkit=tk.ref,
                image_loading=loading,
                ttl_running_stop=120,
            )
            async with await client.run_container(args) as sb:
                r = await sb.run_shell(
                    "cat /etc/motd; ls /data; ls /opt/x; cat /workspace/repo.txt /tools/grade"
                )
                assert r.exit_code == 0, r.stderr
                assert r.stdout.split() == ["toolkit", "b", "new", "repo", "g"], loading
                # The sandbox writes on its own upper layer, never into a shared layer.
                w = await sb.run_shell("echo mine > /etc/motd && cat /etc/motd")
                assert w.stdout == "mine\n"
        cache = await client.layer_cache()
        assert cache["lazy"]["fetch_bytes"] > 0
        assert ws.digest != tk.digest
    finally:
        await client.close()


async def test_version_update_new_sandboxes_get_it_old_keep_theirs(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    big = os.urandom(300_000)
    _publish(store, tmp_path, "task", "cur", {"workspace/v": b"1\n", "workspace/big": big})
    client = await _client(lazy_platform)
    try:
        args = DSecContainerRunArgs(container_image="bb:1", workspace="task:cur")
        old = await client.run_container(args)
        assert (await old.run_shell("cat /workspace/v")).stdout == "1\n"
        _publish(store, tmp_path, "task", "cur", {"workspace/v": b"2\n", "workspace/big": b"x"})
        await client.pull_layer("task:cur", blob=False)  # this platform learns the new version
        async with await client.run_container(args) as new:
            assert (await new.run_shell("cat /workspace/v")).stdout == "2\n"
        # The old sandbox keeps its layer, also for data it had never read before.
        r = await old.run_shell("md5sum /workspace/big; cat /workspace/v")
        assert r.exit_code == 0 and r.stdout.endswith("1\n"), r
        import hashlib

        assert r.stdout.split()[0] == hashlib.md5(big).hexdigest()
        await old.stop()
    finally:
        await client.close()


def _flip_in_blob(store: StoreServer, digest: str, marker: bytes) -> None:
    path = DirStore(store.root).blob_path(digest)
    data = path.read_bytes()
    at = data.find(marker)
    assert at > 0
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.seek(at + 10)
        fh.write(b"X")


async def test_corrupt_blob_is_refused(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    marker = b"MARKER-" + secrets.token_hex(8).encode()
    layer = _publish(
        store,
        tmp_path,
        "bad",
        "1",
        {"w/good": b"fine\n", "w/big": os.urandom(200_000) + marker + os.urandom(9000)},
    )
    _flip_in_blob(store, layer.digest, marker)
    client = await _client(lazy_platform)
    try:
        eager = DSecContainerRunArgs(
            container_image="bb:1", workspace="bad:1", image_loading="eager"
        )
        with pytest.raises(CorruptBlob):
            await client.run_container(eager)
        lazy = DSecContainerRunArgs(container_image="bb:1", workspace="bad:1")
        async with await client.run_container(lazy) as sb:
            assert (await sb.run_shell("cat /w/good")).stdout == "fine\n"
            r = await sb.run_shell("cat /w/big > /dev/null")
            assert r.exit_code != 0 and "Input/output error" in r.stderr, r
        cache = await client.layer_cache()
        assert cache["lazy"]["verify_failures"] >= 1
    finally:
        await client.close()


async def test_store_unreachable_mid_read_then_recovers(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    data = os.urandom(400_000)
    _publish(store, tmp_path, "flaky", "1", {"w/one": data, "w/two": data[::-1]})
    client = await _client(lazy_platform)
    try:
        args = DSecContainerRunArgs(container_image="bb:1", workspace="flaky:1")
        async with await client.run_container(args) as sb:
            assert (await sb.run_shell("cat /w/one > /dev/null")).exit_code == 0
            store.stop()
            try:
                r = await sb.run_shell("cat /w/two > /dev/null")
                assert r.exit_code != 0 and "Input/output error" in r.stderr, r
                assert (await client.health()).status == "ok"  # the edge survives
                assert (await sb.run_shell("echo alive")).stdout == "alive\n"
            finally:
                store.start()
            r = await sb.run_shell("cat /w/two | md5sum")
            import hashlib

            assert r.exit_code == 0 and r.stdout.split()[0] == hashlib.md5(data[::-1]).hexdigest()
    finally:
        await client.close()


async def test_eviction_never_removes_a_layer_in_use(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    one = _publish(store, tmp_path, "evict", "1", {"w/f": os.urandom(3 << 20)})
    two = _publish(store, tmp_path, "evict", "2", {"w/f": os.urandom(3 << 20)})
    client = await _client(lazy_platform)
    try:
        a = await client.run_container(
            DSecContainerRunArgs(container_image="bb:1", workspace="evict:1")
        )
        assert (await a.run_shell("cat /w/f > /dev/null")).exit_code == 0
        async with await client.run_container(
            DSecContainerRunArgs(container_image="bb:1", workspace="evict:2")
        ) as b:
            assert (await b.run_shell("cat /w/f > /dev/null")).exit_code == 0
        # Over budget (1 MiB) the whole time: evict:2 went when its sandbox stopped
        # (the warm sandbox of its shape let go of it), evict:1 is still used by a and
        # must still be complete.
        cached = await _cached_once_gone(client, two.digest)
        assert cached[one.digest]["users"] >= 1
        r = await a.run_shell("cat /w/f | wc -c")
        assert r.stdout.strip() == str(3 << 20)
        await a.stop()
        assert one.digest not in await _cached_once_gone(client, one.digest)
    finally:
        await client.close()


async def _cached_once_gone(client: DSecClient, digest: str) -> dict[str, Any]:
    """The layer cache's entries once ``digest`` left it (a warm sandbox holding it is
    torn down first, in the background), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        cached = {e["digest"]: e for e in (await client.layer_cache())["layers"]}
        if digest not in cached or time.monotonic() > deadline:
            return cached
        await asyncio.sleep(0.05)


async def test_restart_adopts_the_lazy_daemon(
    store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    data = os.urandom(500_000)
    _publish(store, tmp_path, "adopt", "1", {"w/one": data})
    env = {"DSEC_LAYER_STORE": store.url, "DSEC_LAYER_STORE_TOKEN": TOKEN}
    with platform_process(**env) as plat:
        client = await _client(plat)
        try:
            args = DSecContainerRunArgs(container_image="bb:1", workspace="adopt:1")
            sb = await client.run_container(args)
            state = plat.data_dir / "images" / "lazy" / "daemon.json"
            pid = int(state.read_text().split('"pid": ')[1].split(",")[0])
            plat.kill()
            plat.start()
            assert int(state.read_text().split('"pid": ')[1].split(",")[0]) == pid
            r = await sb.run_shell("cat /w/one | wc -c")
            assert r.stdout.strip() == str(len(data))
            await sb.stop()
        finally:
            await client.close()


def test_store_server_auth_ranges_and_digests(store: StoreServer, base: LayerInfo) -> None:
    blob = f"{store.url}/v1/blobs/{base.digest}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(blob).status_code == 401
    assert httpx.get(blob, headers={"Authorization": "Bearer nope"}).status_code == 401
    r = httpx.get(blob, headers={**auth, "Range": "bytes=4096-8191"})
    assert r.status_code == 206 and len(r.content) == 4096
    whole = DirStore(store.root).blob_path(base.digest).read_bytes()
    assert r.content == whole[4096:8192]
    bad = httpx.get(blob, headers={**auth, "Range": f"bytes={len(whole)}-"})
    assert bad.status_code == 416 and bad.json()["error"]["code"] == "range_not_satisfiable"
    wrong = "sha256:" + "0" * 64
    put = httpx.put(f"{store.url}/v1/blobs/{wrong}", content=b"not that", headers=auth)
    assert put.status_code == 422 and put.json()["error"]["code"] == "invalid_argument"
    index = httpx.get(f"{store.url}/v1/indexes/{base.digest}", headers=auth).content
    parsed = ChunkIndex.from_bytes(index, blob_digest=base.digest, index_digest=base.index_digest)
    assert parsed.blob_size == len(whole)
    assert parsed.check_chunk(1, whole[parsed.chunk_size : 2 * parsed.chunk_size])
    with pytest.raises(CorruptBlob):
        ChunkIndex.from_bytes(index, index_digest="sha256:" + "1" * 64)


def test_chunk_index_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(300_000))
    index = build_index(path, 64 * 1024)
    assert index.nchunks == 5 and index.blob_size == 300_000
    again = ChunkIndex.from_bytes(index.to_bytes(), blob_digest=index.blob_digest)
    assert again == index
    with pytest.raises(CorruptBlob):
        ChunkIndex.from_bytes(index.to_bytes()[:-1])


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A git checkout (one commit plus an untracked file), a directory and a tar."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "main.py").write_text("print('v1')\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    (repo / "untracked.txt").write_text("not in the layer\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "grade.sh").write_text("echo graded\n")
    tarball = tmp_path / "data.tar"
    subprocess.run(["tar", "-C", str(tools), "-cf", str(tarball), "."], check=True)
    return repo, tools, tarball


async def test_build_workspace_from_git_dir_and_tar(
    platform: PlatformProcess, busybox_image: str, sources: tuple[Path, Path, Path]
) -> None:
    repo, tools, tarball = sources
    client = await _client(platform)
    try:
        ws = await client.build_layer("repo", "git", str(repo), prefix="/workspace")
        again = await client.build_layer("repo:again", "git", str(repo), prefix="/workspace")
        assert again.digest == ws.digest  # same commit: nothing rebuilt
        tk = await client.build_layer(
            "tools:1", "dir", str(tools), prefix="/opt/tools", kind="toolkit"
        )
        data = await client.build_layer("data:1", "tar", str(tarball), prefix="/data")
        assert {i.ref for i in await client.list_layers()} >= {"repo:latest", "tools:1", "data:1"}
        await client.tag_layer("tools:1", "tools:stable")
        args = DSecContainerRunArgs(
            container_image=busybox_image, workspace="repo", toolkit="tools:stable"
        )
        async with await client.run_container(args) as sb:
            r = await sb.run_shell("cat /workspace/main.py; sh /opt/tools/grade.sh; ls /workspace")
            assert r.stdout == "print('v1')\ngraded\nmain.py\n", r
        with pytest.raises(Unsupported):
            await client.push_layer("tools:1")  # no shared store configured
        for ref in ("repo:again", "tools:stable", "tools:1", "data:1", "repo"):
            await client.remove_layer(ref)
        assert tk.digest and data.digest
    finally:
        await client.close()


def test_layer_cli(platform: PlatformProcess, busybox_image: str, tmp_path: Path) -> None:
    src = tmp_path / "ws"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "hello.txt").write_text("hi\n")
    env = dict(os.environ, DSEC_URL=platform.url, DSEC_API_KEY=platform.api_key)

    def dsec(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dsec.cli.main", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    built = dsec("layer", "build", "cli-ws:1", "--dir", str(src), "--prefix", "/w", "--json")
    assert built.returncode == 0, built.stderr
    assert '"cli-ws"' in built.stdout
    assert dsec("layer", "tag", "cli-ws:1", "cli-ws:2").returncode == 0
    listed = dsec("layer", "ls")
    assert "cli-ws:1" in listed.stdout and "cli-ws:2" in listed.stdout
    pushed = dsec("layer", "push", "cli-ws:1")
    assert pushed.returncode == 1 and "unsupported" in pushed.stderr
    bad = dsec("layer", "build", "Bad:1", "--dir", str(src))
    assert bad.returncode == 1 and "invalid_argument" in bad.stderr
    for ref in ("cli-ws:1", "cli-ws:2"):
        assert dsec("layer", "rm", ref).returncode == 0


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU")
async def test_a_microvm_reads_a_lazy_layer_through_the_chunk_cache(
    lazy_platform: PlatformProcess, store: StoreServer, base: LayerInfo, tmp_path: Path
) -> None:
    """The guest's drive is the layer's dsec-lazyfs file: what it never reads is never
    fetched, what it reads comes through the same verified chunk cache as containers'."""
    import hashlib

    from dsec import DSecMicroVMRunArgs

    big = os.urandom(8 << 20)
    ws = _publish(store, tmp_path, "vmws", "1", {"workspace/big": big, "workspace/s": b"s\n"})
    client = await _client(lazy_platform)
    try:
        before = (await client.layer_cache())["lazy"]["fetch_bytes"]
        args = DSecMicroVMRunArgs(
            image="bb:1", workspace=ws.ref, memory_limit_mb=256, disk_limit_mb=64
        )
        sb = await client.run_microvm(args, timeout=180)
        try:
            assert (await sb.run_shell("cat /workspace/s")).stdout == "s\n"
            fetched = (await client.layer_cache())["lazy"]["fetch_bytes"] - before
            assert fetched < len(big) // 2, f"{fetched} bytes fetched before /workspace/big"
            r = await sb.run_shell("md5sum /workspace/big", timeout=120)
            assert r.stdout.split()[0] == hashlib.md5(big).hexdigest(), r.stderr
            fetched = (await client.layer_cache())["lazy"]["fetch_bytes"] - before
            assert fetched >= len(big)
        finally:
            await sb.stop()
    finally:
        await client.close()
