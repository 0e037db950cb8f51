"""File operations on the data path, including every escape attempt we could think of:
planted symlinks to host paths and to /proc/1/root, `..` in paths, hostile archives.
Real platform, real sandboxes."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, Sandbox
from dsec.errors import FileNotFound, InvalidArgument, PermissionDenied
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

MiB = 1 << 20


@pytest.fixture
def sb(roomy_sandbox: Sandbox) -> Sandbox:
    return roomy_sandbox


def untouched(secret: Path) -> bool:
    return secret.read_text() == "HOST SECRET"


@pytest.fixture
def host_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST SECRET")
    return secret


async def test_read_write_text_bytes_and_streams(sb: Sandbox, tmp_path: Path) -> None:
    await sb.write_file("/tmp/a/b/t.txt", "héllo")
    assert await sb.read_text("/tmp/a/b/t.txt") == "héllo"
    blob = os.urandom(MiB) + bytes(range(256))
    await sb.write_file("/root/blob", blob, mode=0o600)
    assert await sb.read_file("/root/blob") == blob
    assert (await sb.stat("/root/blob")).mode == 0o600
    big = tmp_path / "big"
    big.write_bytes(os.urandom(24 * MiB))
    await sb.write_stream("/tmp/big", big)
    got = bytearray()
    chunks = 0
    async for chunk in sb.read_stream("/tmp/big"):
        got += chunk
        chunks += 1
    assert bytes(got) == big.read_bytes() and chunks > 1

    async def gen() -> AsyncIterator[bytes]:
        for i in range(5):
            yield bytes([i]) * 100_000

    await sb.write_stream("/tmp/gen", gen())
    assert (await sb.stat("/tmp/gen")).size == 500_000
    with pytest.raises(FileNotFound):
        await sb.read_file("/no/such/file")
    with pytest.raises(InvalidArgument):
        await sb.read_file("relative/path")
    with pytest.raises(InvalidArgument):
        await sb.read_file("/tmp")  # a directory


async def test_list_stat_mkdir_remove_move_chmod(sb: Sandbox) -> None:
    await sb.mkdir("/w/x/y/z")
    await sb.mkdir("/w/x/y/z")  # -p: existing is fine
    with pytest.raises(InvalidArgument):
        await sb.mkdir("/w/x", parents=False)
    await sb.write_file("/w/x/f1", b"1")
    await sb.write_file("/w/x/y/f2", b"22")
    await sb.run_shell("ln -s f1 /w/x/link; ln -s / /w/x/root-link")
    top = await sb.list_dir("/w/x")
    assert sorted(e.path for e in top.entries) == ["f1", "link", "root-link", "y"]
    deep = await sb.list_dir("/w", recursive=True)
    assert {e.path for e in deep.entries} == {
        "x", "x/f1", "x/link", "x/root-link", "x/y", "x/y/z", "x/y/f2"
    }  # fmt: skip
    link = next(e for e in deep.entries if e.path == "x/root-link")
    assert link.type == "symlink" and link.target == "/"  # reported, never walked into
    limited = await sb.list_dir("/w", recursive=True, limit=3)
    assert len(limited.entries) == 3 and limited.truncated
    st = await sb.stat("/w/x/link")
    assert st.type == "symlink" and st.target == "f1"
    assert (await sb.stat("/w/x/link", follow=True)).type == "file"
    await sb.chmod("/w/x/f1", 0o700)
    assert (await sb.stat("/w/x/f1")).mode == 0o700
    await sb.move("/w/x/f1", "/w/moved")
    assert await sb.read_file("/w/moved") == b"1" and not await sb.exists("/w/x/f1")
    with pytest.raises(InvalidArgument, match="not empty"):
        await sb.remove("/w/x")
    await sb.remove("/w/moved")
    await sb.remove("/w", recursive=True)
    assert not await sb.exists("/w")
    # The recursive remove deleted the link to / and left / alone.
    assert await sb.exists("/etc/passwd")
    with pytest.raises(FileNotFound):
        await sb.remove("/w")


async def test_symlink_escape_attempts(sb: Sandbox, host_secret: Path) -> None:
    host_dir = host_secret.parent
    await sb.run_shell(
        f"ln -s {host_secret} /tmp/to-host; ln -s {host_dir} /tmp/to-host-dir; "
        "ln -s /proc/1/root /tmp/to-pid1; mkdir -p /tmp/d; ln -s /etc /tmp/d/etc"
    )
    # The link resolves inside the sandbox, where the host path does not exist.
    with pytest.raises(FileNotFound):
        await sb.read_file("/tmp/to-host")
    with pytest.raises(FileNotFound):
        await sb.list_dir("/tmp/to-host-dir")
    with pytest.raises(FileNotFound):
        await sb.stat("/tmp/to-host", follow=True)
    with pytest.raises(FileNotFound):
        await sb.chmod("/tmp/to-host", 0o777)
    # pid 1 is not dumpable: /proc/1/root is closed even to root in the sandbox.
    with pytest.raises(PermissionDenied):
        await sb.read_file("/tmp/to-pid1/etc/passwd")
    with pytest.raises(PermissionDenied):
        await sb.list_dir("/tmp/to-pid1")
    with pytest.raises(PermissionDenied):
        await sb.mkdir("/tmp/to-pid1/evil")
    with pytest.raises(PermissionDenied):
        await sb.write_file("/proc/1/root/tmp/evil", b"x")
    # Writes through links land in the sandbox; the host file is untouched.
    await sb.write_file(f"{host_dir}/host-secret.txt", b"overwritten?")
    await sb.write_file("/tmp/to-host", b"overwritten?")
    await sb.move("/tmp/d", f"{host_dir}/moved")
    await sb.remove("/tmp/to-host-dir", recursive=True)
    assert untouched(host_secret)
    assert not (host_dir / "moved").exists()
    assert sorted(p.name for p in host_dir.iterdir()) == ["host-secret.txt"]
    # A recursive remove deletes a link to a directory, never what it points to.
    await sb.remove(f"{host_dir}/moved", recursive=True)
    assert await sb.exists("/etc/passwd")


async def test_download_keeps_links_as_links(
    sb: Sandbox, host_secret: Path, tmp_path: Path
) -> None:
    await sb.mkdir("/out/sub")
    await sb.write_file("/out/sub/data.bin", bytes(range(256)) * 4)
    await sb.write_file("/out/empty", b"")
    await sb.run_shell(
        f"ln -s {host_secret} /out/host-link; ln -s /proc/1/root /out/pid1; "
        "ln -s ../../etc/passwd /out/sub/up; mkfifo /out/fifo"
    )
    tar_bytes = b"".join([chunk async for chunk in sb.download_tar("/out")])
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {
            "sub", "sub/data.bin", "empty", "host-link", "pid1", "sub/up"
        }  # fmt: skip
        assert members["host-link"].issym() and members["host-link"].linkname == str(host_secret)
        assert members["pid1"].issym()
        f = tar.extractfile("sub/data.bin")
        assert f is not None and f.read() == bytes(range(256)) * 4
    assert b"HOST SECRET" not in tar_bytes
    local = tmp_path / "download"
    await sb.download_dir("/out/sub", local)
    assert (local / "data.bin").read_bytes() == bytes(range(256)) * 4
    assert not (local / "up").is_symlink()  # would point outside: skipped locally
    assert untouched(host_secret)


def _tar(*members: tuple[str, bytes | str | None]) -> bytes:
    """(name, bytes) is a file, (name, "->target") a symlink, (name, None) a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            elif isinstance(content, str):
                info.type = tarfile.SYMTYPE
                info.linkname = content.removeprefix("->")
                tar.addfile(info)
            else:
                info.size = len(content)
                info.mode = 0o640
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


async def test_upload_dir_round_trip(sb: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "pkg" / "deep" / "b.bin").write_bytes(os.urandom(300_000))
    (src / ("n" * 150)).write_text("long name")
    os.symlink("pkg/a.py", src / "alias")
    stats = await sb.upload_dir(src, "/srv/app")
    assert stats["files"] == 3 and stats["symlinks"] == 1
    assert await sb.read_file("/srv/app/pkg/deep/b.bin") == (src / "pkg/deep/b.bin").read_bytes()
    assert (await sb.run_shell("cat /srv/app/alias")).stdout == "print('a')\n"
    assert await sb.read_text("/srv/app/" + "n" * 150) == "long name"
    back = tmp_path / "back"
    await sb.download_dir("/srv/app", back)
    assert (back / "pkg/deep/b.bin").read_bytes() == (src / "pkg/deep/b.bin").read_bytes()
    assert os.readlink(back / "alias") == "pkg/a.py"


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ((("../evil", b"x"),), "'..'"),
        ((("/abs/evil", b"x"),), "absolute"),
        ((("ok/../../evil", b"x"),), "'..'"),
        ((("link", "->/etc"),), "absolute"),
        ((("d", None), ("d/link", "->../../etc")), "outside"),
        ((("link", "->sub"), ("sub", None), ("link/evil", b"x")), "below a symlink"),
    ],
)
async def test_hostile_archives_are_refused(
    platform: PlatformProcess, sb: Sandbox, members: tuple[tuple[str, object], ...], why: str
) -> None:
    data = _tar(*members)  # type: ignore[arg-type]
    info = sb.info.data_path
    assert info is not None
    async with httpx.AsyncClient(base_url=info.url) as http:
        resp = await http.put(
            f"/v1/edge/sandboxes/{sb.id}/archive",
            params={"path": "/dest/inner"},
            content=data,
            headers={"Authorization": f"Bearer {info.token}"},
        )
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["code"] == "invalid_argument"
    assert why in resp.json()["error"]["message"]
    r = await sb.run_shell("ls /evil /dest/evil /etc/evil 2>&1; find /dest -name evil")
    assert "evil" not in r.stdout.replace("No such file", "").split("\n")[-1]
    assert not await sb.exists("/dest/evil") and not await sb.exists("/evil")


async def test_proxy_routes_and_api_key_on_the_edge(platform: PlatformProcess, sb: Sandbox) -> None:
    await sb.write_file("/tmp/p.txt", b"proxied")
    headers = {"Authorization": f"Bearer {platform.api_key}"}
    async with httpx.AsyncClient(base_url=platform.url, headers=headers) as http:
        resp = await http.get(f"/v1/sandboxes/{sb.id}/fs/stat", params={"path": "/tmp/p.txt"})
        assert resp.status_code == 200 and resp.json()["size"] == 7
        resp = await http.get(f"/v1/edge/sandboxes/{sb.id}/files", params={"path": "/tmp/p.txt"})
        assert resp.content == b"proxied"
        resp = await http.get(f"/v1/sandboxes/{sb.id}/fs/list", params={"path": "relative"})
        assert resp.status_code == 422
        resp = await http.post(f"/v1/sandboxes/{sb.id}/fs/chmod", json={"path": "/tmp/p.txt"})
        assert resp.status_code == 422
    async with DSecClient(platform.url, platform.api_key, data_path="proxy") as proxied:
        handle = await proxied.get(sb.id)
        assert (await handle.run_shell("cat /tmp/p.txt")).stdout == "proxied"
        assert await handle.read_file("/tmp/p.txt") == b"proxied"


async def test_file_ops_and_sessions_as_an_unprivileged_user(
    client: DSecClient, busybox_image: str
) -> None:
    sandbox = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, init_user="1000:1000")
    )
    try:
        with pytest.raises(PermissionDenied):
            await sandbox.write_file("/etc/evil", b"x")
        with pytest.raises(PermissionDenied):
            await sandbox.list_dir("/root")
        with pytest.raises(PermissionDenied):
            await sandbox.remove("/etc/passwd")
        with pytest.raises(PermissionDenied):
            await sandbox.chmod("/etc/passwd", 0o666)
        await sandbox.mkdir("/tmp/mine/sub")
        await sandbox.write_file("/tmp/mine/sub/f", b"ok")
        st = await sandbox.stat("/tmp/mine/sub/f")
        assert (st.uid, st.gid) == (1000, 1000)
        sess = await sandbox.session()
        await sess.run("cd /tmp/mine && export ME=$(id -u)")
        assert (await sess.run("pwd; echo $ME")).stdout == "/tmp/mine\n1000\n"
        term = await sandbox.pty(command="id -u")
        out = b""
        while data := await term.read():
            out += data
        assert b"1000" in out
    finally:
        await sandbox.stop()
