"""libdsec against a real uvicorn server on loopback, backed by the in-memory FakeEdge.

Covers paper Listing 1, typed error re-raising, uploads, and async/sync parity. The
server runs in its own thread and event loop so the blocking client can use it too.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import io
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import dsec
from dsec import (
    DSecClient,
    DSecContainerRunArgs,
    DSecSyncClient,
    ExecResult,
    Sandbox,
    SandboxInfo,
    SandboxState,
    SyncSandbox,
)
from dsec.apiserver import ApiLimits
from dsec.errors import (
    AdmissionRejected,
    DSecError,
    FileNotFound,
    ImageNotFound,
    InvalidArgument,
    LimitExceeded,
    PlatformUnavailable,
    SandboxNotFound,
    SandboxNotRunning,
    Timeout,
    Unauthenticated,
)
from dsec.sdk import _protocol as proto
from dsec.sdk._upload import open_upload
from tests.ports import free_port
from tests.test_apiserver_unit import KEY, FakeEdge, make_fake_app

LIMITS = ApiLimits(max_file_bytes=1024 * 1024, max_import_bytes=8 * 1024 * 1024)


class LiveServer:
    """The apiserver with FakeEdge, served by uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, db: Path, limits: ApiLimits = LIMITS) -> None:
        self._db = db
        self._limits = limits
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on such sockets, and
        # without it every response waits ~40 ms for a delayed ACK (Nagle).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._ready = threading.Event()
        self._server: uvicorn.Server | None = None
        self.edge: FakeEdge | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        app, self.edge, engine = await make_fake_app(self._db, self._limits)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        serving = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.01)
        self._ready.set()
        await serving
        await engine.dispose()

    def start(self) -> LiveServer:
        self._thread.start()
        assert self._ready.wait(20), "server did not start"
        return self

    def stop(self) -> None:
        assert self._server is not None
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    @property
    def fake(self) -> FakeEdge:
        assert self.edge is not None
        return self.edge


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path_factory.mktemp("sdk") / "keys.db").start()
    yield server
    server.stop()


@pytest.fixture
async def client(live: LiveServer) -> Any:
    c = DSecClient(live.url, KEY)
    await c.open()
    yield c
    await c.close()


@pytest.fixture
def sync_client(live: LiveServer) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(live.url, KEY) as c:
        yield c


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


ARGS = DSecContainerRunArgs(
    container_image="busybox:latest",
    memory_limit_mb=512,
    cpu_cores_limit=1,
    ttl_running_stop=300,
    init_user="root",
)


# ---- Listing 1 -------------------------------------------------------------------------


async def test_listing_1(live: LiveServer) -> None:
    client = DSecClient(live.url, KEY)
    await client.open()
    sandbox = await client.run_container(ARGS, timeout=120)
    assert isinstance(sandbox, Sandbox) and sandbox.state is SandboxState.RUNNING
    result = await sandbox.run_shell("echo hello world")
    assert isinstance(result, ExecResult)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello world\n", "")
    assert not result.timed_out and not result.truncated and result.duration >= 0
    await sandbox.write_file("/tmp/a.txt", b"x\x00y")
    assert await sandbox.read_file("/tmp/a.txt") == b"x\x00y"
    await sandbox.write_file("/tmp/s.txt", "grüße", mode=0o600)
    assert (await sandbox.read_file("/tmp/s.txt")).decode() == "grüße"
    assert live.fake.files[(sandbox.id, "/tmp/s.txt")][1] == 0o600
    final = await sandbox.stop()
    assert final.state is SandboxState.STOPPED and sandbox.info is final
    await client.close()
    await client.close()  # idempotent


async def test_timeout_maps_to_request_field(client: DSecClient, live: LiveServer) -> None:
    call = proto.create_sandbox(ARGS, 42)
    assert call.timeout is not None and call.timeout.read is not None
    assert 42 < call.timeout.read < 60
    assert b'"timeout":42' in (call.content or b"")
    sb = await client.run_container(ARGS, timeout=42)
    await sb.stop()


async def test_exec_options_and_argv(client: DSecClient, live: LiveServer) -> None:
    async with await client.run_container(ARGS) as sb:
        r = await sb.exec(["env"], env={"A": "1", "B": "two"}, workdir="/tmp", user="1000:1000")
        assert r.stdout == "A=1\nB=two\n"
        req = live.fake.execs[-1]
        assert (req.command, req.workdir, req.user) == (["env"], "/tmp", "1000:1000")
        r = await sb.run_shell("cat", stdin="fed", timeout=5)
        assert r.stdout == "fed" and live.fake.execs[-1].timeout == 5
        assert (await sb.run_shell("exit 7")).exit_code == 7
        with pytest.raises(InvalidArgument, match="run_shell"):
            await sb.exec("echo hi")
        with pytest.raises(InvalidArgument, match="exec"):
            await sb.run_shell(["echo"])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="env"):
            await sb.run_shell("echo", env={"1BAD": "x"})
        with pytest.raises(InvalidArgument, match="workdir"):
            await sb.run_shell("echo", workdir="relative")
    assert sb.state is SandboxState.STOPPED, "async with stops the sandbox"


async def test_context_manager_stops_on_error(client: DSecClient, live: LiveServer) -> None:
    with pytest.raises(ZeroDivisionError):
        async with await client.run_container(ARGS) as sb:
            _ = 1 / 0
    assert live.fake.boxes[sb.id].state is SandboxState.STOPPED


async def test_get_list_refresh(client: DSecClient) -> None:
    a = await client.run_container(ARGS.model_copy(update={"labels": {"job": "sdk-list"}}))
    b = await client.run_container(ARGS.model_copy(update={"labels": {"job": "sdk-list"}}))
    got = await client.get(a.id)
    assert got.id == a.id and got.info.labels == {"job": "sdk-list"}
    await b.stop()
    live_ids = {s.id for s in await client.list_sandboxes(labels={"job": "sdk-list"})}
    assert live_ids == {a.id}
    every = await client.list_sandboxes(labels={"job": "sdk-list"}, states=list(SandboxState))
    assert {s.id for s in every} == {a.id, b.id}
    stopped = await client.list_sandboxes(labels={"job": "sdk-list"}, states=["stopped"])
    assert [s.id for s in stopped] == [b.id]
    with pytest.raises(InvalidArgument, match="state"):
        await client.list_sandboxes(states=["zombie"])
    info = await client.stop_sandbox(a.id)
    assert info.state is SandboxState.STOPPED
    assert (await a.refresh()).state is SandboxState.STOPPED


# ---- typed errors ---------------------------------------------------------------------


async def test_server_errors_are_reraised_typed(client: DSecClient, live: LiveServer) -> None:
    with pytest.raises(SandboxNotFound):
        await client.get("e0-0123456789abcdef")
    with pytest.raises(SandboxNotFound, match="ids look like"):
        await client.get("../images")  # refused locally, never becomes another URL
    with pytest.raises(ImageNotFound, match="nothere"):
        await client.run_container(DSecContainerRunArgs(container_image="nothere:1"))
    sb = await client.run_container(ARGS)
    with pytest.raises(FileNotFound):
        await sb.read_file("/missing")
    with pytest.raises(InvalidArgument, match="absolute"):
        await sb.read_file("relative")
    with pytest.raises(LimitExceeded, match="1 MiB"):
        await sb.write_file("/big", b"x" * (LIMITS.max_file_bytes + 1))
    await sb.stop()
    with pytest.raises(SandboxNotRunning) as info:
        await sb.run_shell("echo")
    assert info.value.code == "sandbox_not_running" and info.value.status == 409

    live.fake.capacity = 0
    try:
        with pytest.raises(AdmissionRejected):
            await client.run_container(ARGS)
    finally:
        live.fake.capacity = 1000


async def test_bad_key_is_unauthenticated(live: LiveServer) -> None:
    async with DSecClient(live.url, "dsk_wrong") as c:  # health needs no key
        with pytest.raises(Unauthenticated):
            await c.list_sandboxes()
    with DSecSyncClient(live.url, "dsk_wrong") as s, pytest.raises(Unauthenticated):
        s.list_images()


async def test_unreachable_platform_is_typed_with_hint() -> None:
    url = dead_url()
    c = DSecClient(url, KEY)
    with pytest.raises(PlatformUnavailable) as info:
        await c.open()
    assert url in str(info.value) and "dsec up" in str(info.value)
    assert info.value.details["url"] == url
    await c.close()
    with pytest.raises(PlatformUnavailable, match="dsec up"):
        DSecSyncClient(url, KEY).open()


def test_transport_failures_and_non_json_errors() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    c = DSecSyncClient("http://dsec.test", KEY, transport=httpx.MockTransport(timeout))
    with pytest.raises(Timeout, match="/v1/images"):
        c.list_images()

    def proxy_error(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>bad gateway</html>")

    c = DSecSyncClient("http://dsec.test", KEY, transport=httpx.MockTransport(proxy_error))
    with pytest.raises(DSecError, match="HTTP 502"):
        c.list_images()

    def garbage(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"unexpected": True})

    c = DSecSyncClient("http://dsec.test", KEY, transport=httpx.MockTransport(garbage))
    with pytest.raises(DSecError, match="unexpected response"):
        c.health()


def test_auth_header_and_config_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=[])

    monkeypatch.setenv("DSEC_URL", "http://from-env:1234/")
    monkeypatch.setenv("DSEC_API_KEY", "dsk_env")
    c = DSecSyncClient(transport=httpx.MockTransport(record))
    assert c.url == "http://from-env:1234"
    c.list_images()
    assert seen[-1].headers["authorization"] == "Bearer dsk_env"
    assert str(seen[-1].url) == "http://from-env:1234/v1/images"
    DSecSyncClient(
        "http://explicit", "dsk_arg", transport=httpx.MockTransport(record)
    ).list_images()
    assert seen[-1].headers["authorization"] == "Bearer dsk_arg"


# ---- images and uploads --------------------------------------------------------------


async def test_images_build_list_remove(client: DSecClient, live: LiveServer) -> None:
    info = await client.build_image("debian-python")
    assert info.ref == "debian-python:bookworm"
    assert info.ref in {i.ref for i in await client.list_images()}
    assert (await client.get_image("debian-python:bookworm")).digest == info.digest
    assert (await client.remove_image("debian-python:bookworm")).ref == info.ref
    with pytest.raises(ImageNotFound):
        await client.get_image("debian-python:bookworm")
    with pytest.raises(InvalidArgument, match="recipe"):
        await client.build_image("centos")
    with pytest.raises(InvalidArgument):
        await client.get_image("Bad Ref")


async def test_import_file_fileobj_and_directory(
    client: DSecClient, live: LiveServer, tmp_path: Path
) -> None:
    archive = tmp_path / "rootfs.tar"
    archive.write_bytes(b"A" * 300_000)
    progress: list[tuple[int, int | None]] = []
    info = await client.import_image(
        "team/app:v1", archive, "tar", progress=lambda s, t: progress.append((s, t))
    )
    assert info.ref == "team/app:v1" and info.size_bytes == 300_000
    assert progress[-1] == (300_000, 300_000)
    assert [s for s, _ in progress] == sorted(s for s, _ in progress)

    info = await client.import_image("fileobj:1", io.BytesIO(b"hello"))
    assert live.fake.images.imported["fileobj:1"] == b"hello"

    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "sh").write_bytes(b"#!fake")
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text("ID=test\n")
    (root / "link").symlink_to("bin/sh")
    await client.import_image("dir:1", root)
    with tarfile.open(fileobj=io.BytesIO(live.fake.images.imported["dir:1"])) as tar:
        names = set(tar.getnames())
        assert {"bin/sh", "etc/os-release", "link", "bin", "etc"} <= names
        assert tar.getmember("link").issym()

    with pytest.raises(InvalidArgument, match="cannot read"):
        await client.import_image("x:1", tmp_path / "missing.tar")
    with pytest.raises(InvalidArgument, match="format"):
        await client.import_image("x:1", io.BytesIO(b"a"), "zip")


async def test_import_over_limit(client: DSecClient, tmp_path: Path) -> None:
    big = tmp_path / "big.tar"
    big.write_bytes(b"B" * (LIMITS.max_import_bytes + 10))
    with pytest.raises(LimitExceeded):
        await client.import_image("big:1", big)


def test_directory_archiver_reports_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")

    def boom(*_: Any, **__: Any) -> None:
        raise PermissionError("denied by test")

    monkeypatch.setattr(tarfile.TarFile, "add", boom)
    upload, is_dir = open_upload(tmp_path)
    assert is_dir
    with pytest.raises(InvalidArgument, match="denied by test"):
        b"".join(upload)
    upload.close()


def test_aborted_directory_upload_releases_the_thread(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"z" * (8 * 1024 * 1024))
    before = threading.active_count()
    upload, _ = open_upload(tmp_path)
    next(iter(upload))
    upload.close()
    time.sleep(0.1)
    assert threading.active_count() <= before


# ---- sync twin -------------------------------------------------------------------------


def test_sync_twin_flow(sync_client: DSecSyncClient, live: LiveServer, tmp_path: Path) -> None:
    with sync_client.run_container(ARGS, timeout=30) as sb:
        assert isinstance(sb, SyncSandbox)
        assert sb.run_shell("echo hello world").stdout == "hello world\n"
        assert sb.exec(["exit", "2"]).exit_code == 2
        sb.write_file("/tmp/a.txt", "x")
        assert sb.read_file("/tmp/a.txt") == b"x"
        assert sync_client.get(sb.id).id == sb.id
        assert sb.id in {s.id for s in sync_client.list_sandboxes()}
        assert sb.refresh().state is SandboxState.RUNNING
    assert sb.state is SandboxState.STOPPED
    with pytest.raises(SandboxNotRunning):
        sb.run_shell("echo")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    assert sync_client.import_image("syncdir:1", tmp_path / "d").ref == "syncdir:1"
    assert sync_client.build_image("busybox").ref == "busybox:latest"


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"), [(DSecClient, DSecSyncClient), (Sandbox, SyncSandbox)]
)
def test_sync_twin_has_the_same_api(async_cls: type, sync_cls: type) -> None:
    def api(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(member).parameters)
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")
        }

    assert api(async_cls) == api(sync_cls)
    for name, member in inspect.getmembers(async_cls, inspect.isfunction):
        if not name.startswith("_") and name != "__init__":
            # Streams are async generators; ``stream`` and ``trajectory`` return handles
            # (to iterate with async for, to send steps through) and ``vnc_url`` a page's
            # address, all without I/O.
            handle = inspect.isasyncgenfunction(member) or name in (
                "stream",
                "trajectory",
                "vnc_url",
            )
            assert inspect.iscoroutinefunction(member) or handle, name


# ---- performance and packaging -------------------------------------------------------


async def test_concurrent_execs_share_one_pool(client: DSecClient) -> None:
    sandboxes = await asyncio.gather(*(client.run_container(ARGS) for _ in range(20)))
    results = await asyncio.gather(*(sb.run_shell(f"echo {i}") for i, sb in enumerate(sandboxes)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]
    await asyncio.gather(*(sb.stop() for sb in sandboxes))


def test_exec_roundtrip_is_fast(sync_client: DSecSyncClient) -> None:
    """HTTP-layer overhead with a fake edge; the platform target is ~2 ms end to end."""
    with sync_client.run_container(ARGS) as sb:
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            sb.run_shell("echo x")
            samples.append(time.perf_counter() - t0)
    p50 = statistics.median(samples)
    print(f"exec round trip over loopback with FakeEdge: p50 {p50 * 1000:.2f} ms")
    assert p50 < 0.01


def test_sdk_imports_stay_light() -> None:
    # rich/click are left out: httpx itself imports them for its CLI when they are installed.
    code = (
        "import sys, dsec, dsec.sdk\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette', 'sqlalchemy', 'typer', 'uvicorn')]\n"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

    allowed = {
        "dsec.api",  # the wire models (pure pydantic)
        "dsec.errors",
        "dsec.config",
        "dsec.sdk",
        "cloudpickle",  # client.call(fn) only, imported when called
        "dockerfile_parse",  # dsec.sdk.dockerfile only, imported when a build parses
        "httpx",
        "pydantic",
        "websockets",  # the data path and the terminal
    }
    src = Path(dsec.__file__).parent
    for path in [src / "__init__.py", *sorted((src / "sdk").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                assert any(name == a or name.startswith(a + ".") for a in allowed), (path, name)


def test_top_level_exports() -> None:
    for name in [
        "DSecClient",
        "DSecSyncClient",
        "Sandbox",
        "SyncSandbox",
        "DSecContainerRunArgs",
        "ExecResult",
        "SandboxInfo",
        "SandboxState",
        "DSecError",
        "SandboxNotFound",
        "PlatformUnavailable",
        "Timeout",
    ]:
        assert hasattr(dsec, name), name
    assert SandboxInfo is dsec.SandboxInfo
