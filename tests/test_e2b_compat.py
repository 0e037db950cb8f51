"""The unmodified `e2b` SDK (PyPI, pinned) against our platform (dsec.compat.e2b).

The session platform (tests/conftest.py) and three busybox sandboxes: every call goes
through the E2B SDK with E2B_API_URL = E2B_SANDBOX_URL = the platform URL and
E2B_API_KEY = one of our keys, sync and async, including what a hostile caller tries.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402

from dsec import DSecSyncClient  # noqa: E402
from tests.conftest import PlatformProcess  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def e2b_env(platform: PlatformProcess, busybox_image: str) -> Iterator[PlatformProcess]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", platform.url)
        mp.setenv("E2B_SANDBOX_URL", platform.url)
        mp.setenv("E2B_API_KEY", platform.api_key)
        yield platform


@pytest.fixture(scope="module")
def sbx(e2b_env: PlatformProcess, busybox_image: str) -> Iterator[Sandbox]:
    box = Sandbox.create(busybox_image, metadata={"suite": "e2b"}, envs={"GREETING": "hi"})
    yield box
    box.kill()


def test_commands_foreground_streams_and_exit_codes(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        "echo $GREETING; echo oops >&2; whoami; pwd", on_stdout=out.append, on_stderr=err.append
    )
    assert result.exit_code == 0
    assert result.stdout.split() == ["hi", "user", "/home/user"]
    assert "".join(out).split() == ["hi", "user", "/home/user"]
    assert "oops" in result.stderr and "oops" in "".join(err)
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo bad; exit 3")
    assert info.value.exit_code == 3 and "bad" in info.value.stdout
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"
    assert sbx.commands.run("echo $X; pwd", envs={"X": "y"}, cwd="/tmp").stdout.split() == [
        "y",
        "/tmp",
    ]
    big = sbx.commands.run("seq 1 200000")  # ~1.3 MB in many chunks, none lost
    lines = big.stdout.split()
    assert len(lines) == 200000 and lines[-1] == "200000"


def test_background_stdin_list_connect_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "ping\n")
    again = sbx.commands.connect(handle.pid)
    sbx.commands.close_stdin(handle.pid)
    result = again.wait()
    assert result.exit_code == 0 and "ping" in result.stdout
    sleeper = sbx.commands.run("sleep 300", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as info:
        sleeper.wait()
    assert info.value.exit_code == 137
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(999999) is False


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", "hello")  # multipart upload
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("notes/a.txt") == "hello"
    sbx.files.write("/home/user/notes/b.bin", b"\x00\x01", use_octet_stream=True)
    assert sbx.files.read("/home/user/notes/b.bin", format="bytes") == bytearray(b"\x00\x01")
    many = sbx.files.write_files(
        [WriteEntry(path="/tmp/m/1.txt", data="one"), WriteEntry(path="/tmp/m/2.txt", data="two")]
    )
    assert sorted(w.path for w in many) == ["/tmp/m/1.txt", "/tmp/m/2.txt"]
    assert sbx.commands.run("cat /tmp/m/1.txt /tmp/m/2.txt notes/a.txt").stdout == "onetwohello"
    assert sorted(e.name for e in sbx.files.list("/tmp/m")) == ["1.txt", "2.txt"]
    assert sbx.files.exists("/tmp/m/1.txt") and not sbx.files.exists("/tmp/m/nope")
    stat = sbx.files.get_info("/tmp/m/2.txt")
    assert stat.type == FileType.FILE and stat.size == 3
    assert sbx.files.get_info("/tmp/m").type == FileType.DIR
    assert sbx.files.make_dir("/tmp/d/e") is True
    assert sbx.files.make_dir("/tmp/d/e") is False
    moved = sbx.files.rename("/tmp/m/1.txt", "/tmp/d/e/1.txt")
    assert moved.path == "/tmp/d/e/1.txt" and sbx.files.read("/tmp/d/e/1.txt") == "one"
    sbx.files.remove("/tmp/d")
    assert not sbx.files.exists("/tmp/d")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/d/e/1.txt")
    # A relative path cannot climb out of the sandbox: `..` ends at its own root.
    passwd = sbx.files.read("../../../../../../etc/passwd")
    assert "user:x:1000:1000" in passwd


def test_watch_dir_sync(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/w")
    handle = sbx.files.watch_dir("/tmp/w")
    sbx.files.write("/tmp/w/new.txt", "x")
    events = handle.get_new_events()
    assert [(e.name, e.type) for e in events] == [("new.txt", FilesystemEventType.CREATE)]
    sbx.files.remove("/tmp/w/new.txt")
    assert [e.type for e in handle.get_new_events()] == [FilesystemEventType.REMOVE]
    handle.stop()


def test_lifecycle_list_connect_pause(e2b_env: PlatformProcess, busybox_image: str) -> None:
    tag = secrets.token_hex(4)
    a = Sandbox.create(busybox_image, metadata={"t": tag}, timeout=120)
    b = Sandbox.create("base", metadata={"t": tag, "image": busybox_image})  # slime's key
    try:
        assert a.is_running()
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id and info.metadata == {"t": tag}
        assert info.template_id == busybox_image
        pager = Sandbox.list(query=SandboxQuery(metadata={"t": tag}), limit=1)
        seen = [s.sandbox_id for s in pager.next_items()]
        assert pager.has_next
        seen += [s.sandbox_id for s in pager.next_items()]
        assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id]) and not pager.has_next
        a.set_timeout(60)
        with pytest.raises(SandboxException, match=r"^400: timeout 3600s is longer"):
            a.set_timeout(3600)
        same = Sandbox.connect(a.sandbox_id)
        assert same.commands.run("echo again").stdout == "again\n"
        b.pause()
        assert Sandbox.get_info(b.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(b.sandbox_id)
        assert resumed.commands.run("echo back").stdout == "back\n"
    finally:
        assert a.kill() is True
        b.kill()
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.sandbox_id)
    assert Sandbox.kill(a.sandbox_id) is False


def test_idempotency_key(e2b_env: PlatformProcess, busybox_image: str) -> None:
    key = "e2b-" + secrets.token_hex(6)
    first = Sandbox.create(busybox_image, idempotency_key=key)
    try:
        second = Sandbox.create(busybox_image, idempotency_key=key)
        assert second.sandbox_id == first.sandbox_id
    finally:
        first.kill()


def test_hostile_callers(e2b_env: PlatformProcess, sbx: Sandbox, busybox_image: str) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(busybox_image, api_key="dsk_not_a_key")
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id[:-4] + "ffff")
    # Another project's key sees neither our sandbox nor its envd.
    suffix = secrets.token_hex(3)
    with DSecSyncClient(e2b_env.url, e2b_env.api_key) as admin:
        admin.create_project(f"other{suffix}")
        admin.create_principal(f"stranger{suffix}", default_project=f"other{suffix}")
        admin.grant(f"stranger{suffix}", "runtime", project=f"other{suffix}")
        key = admin.create_key(f"stranger{suffix}").key
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=key)
    assert Sandbox.kill(sbx.sandbox_id, api_key=key) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=key).next_items()]
    # envd: a token of one sandbox does not open another; no token, no access.
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"}
    bad = httpx.post(
        f"{e2b_env.url}/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={**headers, "X-Access-Token": "dst1.x.y.z"},
    )
    assert bad.status_code == 401 and bad.json()["code"] == "unauthenticated"
    anon = httpx.get(f"{e2b_env.url}/files", params={"path": "/etc/passwd"}, headers=headers)
    assert anon.status_code == 401 and "message" in anon.json()
    api = {"X-API-KEY": e2b_env.api_key}
    token = httpx.get(f"{e2b_env.url}/sandboxes/{sbx.sandbox_id}", headers=api).json()
    other = Sandbox.create(busybox_image)
    try:
        crossed = httpx.get(
            f"{e2b_env.url}/files",
            params={"path": "/etc/hostname"},
            headers={
                "E2b-Sandbox-Id": other.sandbox_id,
                "X-Access-Token": token["envdAccessToken"],
            },
        )
        assert crossed.status_code == 403  # a token opens its own sandbox only
    finally:
        other.kill()
    nul = httpx.get(
        f"{e2b_env.url}/files",
        params={"path": "/etc/\x00passwd"},
        headers={**headers, "X-Access-Token": token["envdAccessToken"]},
    )
    assert nul.status_code == 400


@pytest.fixture
async def asbx(e2b_env: PlatformProcess, busybox_image: str) -> AsyncIterator[AsyncSandbox]:
    box = await AsyncSandbox.create(busybox_image)
    yield box
    await box.kill()


async def test_async_sdk(asbx: AsyncSandbox) -> None:
    out: list[str] = []
    result = await asbx.commands.run("echo one; echo two", on_stdout=out.append)
    assert result.stdout == "one\ntwo\n" and "".join(out) == "one\ntwo\n"
    with pytest.raises(CommandExitException):
        await asbx.commands.run("exit 4")
    handle = await asbx.commands.run("read x; echo got $x", background=True, stdin=True)
    await asbx.commands.send_stdin(handle.pid, "it\n")
    assert (await handle.wait()).stdout == "got it\n"
    await asbx.files.write("a/b.txt", "async")
    assert await asbx.files.read("/home/user/a/b.txt") == "async"
    assert [e.name for e in await asbx.files.list("a")] == ["b.txt"]
    seen: list[str] = []
    watch = await asbx.files.watch_dir("/home/user/a", on_event=lambda e: seen.append(e.name))
    await asbx.files.write("a/c.txt", "more")
    deadline = time.monotonic() + 10
    while "c.txt" not in seen and time.monotonic() < deadline:
        await asbx.commands.run("true")  # lets the stream's poll come round
    await watch.stop()  # type: ignore[no-untyped-call]
    assert "c.txt" in seen
    assert await asbx.is_running()
    info = await asbx.get_info()
    assert info.sandbox_id == asbx.sandbox_id


def test_template_and_metadata_select_image_and_backend() -> None:
    from dsec.api.spec import DSecContainerRunArgs, DSecMicroVMRunArgs
    from dsec.compat.e2b.mapping import E2BConfig, create_spec

    config = E2BConfig(default_image="debian-python:latest")
    base = create_spec({"templateID": "base", "timeout": 60}, config, "e2b-j")
    assert isinstance(base, DSecContainerRunArgs)
    assert base.container_image == "debian-python:latest" and base.ttl_running_stop == 60
    chosen = create_spec(
        {"templateID": "base", "metadata": {"image": "busybox:1", "dsec.backend": "microvm"}},
        config,
        "e2b-j",
    )
    assert isinstance(chosen, DSecMicroVMRunArgs) and chosen.image == "busybox:1"
    assert chosen.init_user == "1000:1000" and chosen.env["HOME"] == "/home/user"


def test_bad_create_requests_are_4xx(e2b_env: PlatformProcess) -> None:
    with pytest.raises(SandboxException, match=r"^400: "):
        Sandbox.create("not a valid/../image")
    with pytest.raises(SandboxException, match=r"^400: "):
        Sandbox.create("busybox:latest", metadata={"dsec.backend": "mainframe"})


@pytest.mark.skipif(
    not __import__("shutil").which("qemu-system-x86_64"), reason="needs QEMU (TCG here)"
)
def test_a_microvm_through_the_unmodified_sdk(e2b_env: PlatformProcess, busybox_image: str) -> None:
    """Metadata ``dsec.backend=microvm`` boots a microVM; the SDK cannot tell, the guest
    kernel (not the host's) says it is one."""
    import platform as host

    box = Sandbox.create(
        busybox_image, metadata={"dsec.backend": "microvm"}, timeout=300, request_timeout=180
    )
    try:
        kernel = box.commands.run("uname -r").stdout.strip()
        assert kernel and kernel != host.release(), kernel  # the guest's own kernel
        assert box.commands.run("whoami; pwd").stdout.split() == ["user", "/home/user"]
        box.files.write("notes/a.txt", "in a vm")
        assert box.files.read("notes/a.txt") == "in a vm"
        assert box.get_info().metadata["dsec.backend"] == "microvm"
    finally:
        box.kill()
