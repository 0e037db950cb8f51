"""Image subsystem, for real: mkfs.erofs, kernel EROFS mounts, tar/OCI imports, as root."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from dsec import linux
from dsec.api.images import ImageInfo
from dsec.control.db import make_engine, sqlite_url
from dsec.errors import CorruptBlob, ImageBuildError, ImageNotFound, InvalidArgument
from dsec.images import builders
from dsec.images.images import Images
from dsec.images.mounts import TRACE_USERS_ENV, LayerMounts
from dsec.images.service import ImageService

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount EROFS"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils"),
]

MTIME_NS = 1_600_000_000_123_456_789  # 2020-09-13, with nanoseconds


# -- fixtures and helpers --


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _damage(blob: Path, how: str) -> None:
    """Flip one byte or cut off the tail, as a failing disk or a bad copy would."""
    with open(blob, "r+b") as fh:
        if how == "flip":
            fh.seek(2000)
            byte = fh.read(1)
            fh.seek(2000)
            fh.write(bytes([byte[0] ^ 0xFF]))
        else:
            fh.truncate(os.fstat(fh.fileno()).st_size - 4096)


def _unmount_all(root: Path) -> None:
    """Detach everything mounted below ``root``, deepest first (test cleanup)."""
    if not root.exists():
        return
    for entry in sorted(linux.mounts(root), key=lambda m: m.mount_point, reverse=True):
        linux.umount(entry.mount_point, detach=True)


def _mount_count(path: Path) -> int:
    target = str(path.resolve())
    return sum(1 for m in linux.mounts(target) if m.mount_point == target)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(sqlite_url(tmp_path / "control.sqlite"))
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def images(tmp_path: Path, engine: AsyncEngine, build_cache: Path) -> AsyncIterator[Images]:
    root = tmp_path / "images"
    imgs = Images(root, engine, build_cache=build_cache)  # the session's (tests/conftest.py)
    try:
        await imgs.open()
        yield imgs
    finally:
        _unmount_all(tmp_path)


async def _chunks(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]
        await asyncio.sleep(0)


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]], *, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def _dir(
    name: str, mode: int = 0o755, mtime: float = 1_500_000_000
) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    info.mtime = mtime
    return info, None


def _file(
    name: str,
    data: bytes,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: float = 1_500_000_000,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.mtime = mtime
    return info, data


def _link(name: str, target: str, *, hard: bool = False) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    info.mtime = 1_500_000_000
    return info, None


def _sample_tree(root: Path) -> None:
    """A tree with every kind of entry whose metadata an image must keep."""
    (root / "etc").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "data").mkdir()
    (root / "etc/hello").write_text("hello\n")
    (root / "bin/tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(root / "bin/tool", 0o4755)
    os.symlink("/etc/hello", root / "etc/link")
    os.link(root / "etc/hello", root / "etc/hardlink")
    os.mknod(root / "data/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(root / "data/fifo")
    (root / "data/owned").write_text("x")
    os.chown(root / "data/owned", 1234, 5678)
    os.setxattr(root / "data/owned", "user.dsec", b"kept")
    for path in (root / "etc/hello", root / "bin/tool", root / "data/owned"):
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
    os.utime(root / "etc/link", ns=(MTIME_NS, MTIME_NS), follow_symlinks=False)
    os.utime(root / "data", ns=(MTIME_NS, MTIME_NS))


# -- the built-in busybox image --


async def test_busybox_build_mount_and_contents(images: Images) -> None:
    svc: ImageService = images  # Images implements the protocol
    events: list[tuple[str, int, int | None]] = []
    t0 = time.perf_counter()
    info = await svc.build("busybox", progress=lambda s, d, t: events.append((s, d, t)))
    build_s = time.perf_counter() - t0
    print(f"\nbusybox build: {build_s * 1000:.0f} ms, {info.size_bytes} bytes")
    assert info.ref == "busybox:latest"
    assert len(info.layers) == 1 and info.digest.startswith("sha256:")
    assert events and events[-1][0] == "done"
    assert info.config["user"] == "root" and info.config["workdir"] == "/"

    t0 = time.perf_counter()
    again = await svc.build("busybox")
    assert time.perf_counter() - t0 < 0.5
    assert again.digest == info.digest

    t0 = time.perf_counter()
    mnt = images.mounts.acquire(info.layers[0])
    print(
        f"first layer mount (verified marker, syscall): {(time.perf_counter() - t0) * 1000:.2f} ms"
    )
    try:
        host = os.stat("/bin/busybox")
        bb = (mnt / "bin/busybox").stat()
        assert bb.st_size == host.st_size and stat.S_IMODE(bb.st_mode) == 0o755
        assert bb.st_mtime_ns == host.st_mtime_ns != 0
        assert os.readlink(mnt / "bin/sh") == "/bin/busybox"
        applets = _run(["/bin/busybox", "--list"]).stdout.split()
        found = {
            p.name for d in ("", "bin", "sbin", "usr/bin", "usr/sbin") for p in (mnt / d).iterdir()
        }
        assert set(applets) <= found
        for link in (mnt / "usr/bin").iterdir():
            assert link.lstat().st_mtime_ns == host.st_mtime_ns
        passwd = (mnt / "etc/passwd").read_text()
        assert "nobody:x:65534:65534:" in passwd
        assert "user:x:1000:1000:user:/home/user:/bin/sh" in passwd
        assert stat.S_IMODE((mnt / "tmp").stat().st_mode) == 0o1777
        assert (mnt / "home/user").stat().st_uid == 1000
        assert (mnt / "etc/resolv.conf").read_text() == ""
        for d in ("proc", "sys", "dev", "root"):
            assert (mnt / d).is_dir()
        out = _run(["chroot", str(mnt), "/bin/sh", "-c", "echo hi from $(whoami)"])
        assert out.returncode == 0 and out.stdout.strip() == "hi from root"
    finally:
        images.mounts.release(info.layers[0])
    assert images.mounts.unmount_unused() == [info.layers[0]]
    assert _mount_count(mnt) == 0


# -- importers --


async def test_import_directory_keeps_metadata(images: Images, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _sample_tree(src)
    info = await images.import_directory("sample:v1", src)
    assert (await images.resolve("sample:v1")).digest == info.digest
    mnt = images.mounts.acquire(info.layers[0])
    try:
        for rel in ("etc/hello", "bin/tool", "data/owned", "data"):
            assert (mnt / rel).lstat().st_mtime_ns == MTIME_NS
        assert (mnt / "etc/link").lstat().st_mtime_ns == MTIME_NS
        assert os.readlink(mnt / "etc/link") == "/etc/hello"
        assert (mnt / "etc/hardlink").stat().st_ino == (mnt / "etc/hello").stat().st_ino
        assert (mnt / "etc/hello").stat().st_nlink == 2
        assert stat.S_IMODE((mnt / "bin/tool").stat().st_mode) == 0o4755
        null = (mnt / "data/null").lstat()
        assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
        assert stat.S_ISFIFO((mnt / "data/fifo").lstat().st_mode)
        owned = (mnt / "data/owned").stat()
        assert (owned.st_uid, owned.st_gid) == (1234, 5678)
        assert os.getxattr(mnt / "data/owned", "user.dsec") == b"kept"
        with pytest.raises(OSError):
            (mnt / "etc/new").write_text("read-only")
    finally:
        images.mounts.release(info.layers[0])


async def test_import_rootfs_tar(images: Images) -> None:
    fine = tarfile.TarInfo("./usr/bin/fine")
    fine.mode, fine.uid, fine.gid = 0o755, 42, 43
    fine.pax_headers = {"mtime": "1600000000.123456789"}
    data = _tar(
        [
            _dir("./"),
            _dir("./usr", mtime=1_400_000_000),
            _dir("./usr/bin", mtime=1_400_000_000),
            (fine, b"fine\n"),
            _link("./usr/bin/alias", "fine"),
            _link("./usr/bin/hard", "./usr/bin/fine", hard=True),
            _dir("./tmp", mode=0o1777),
        ],
        gz=True,
    )
    info = await images.import_archive("rootfs:tar", _chunks(data), fmt="auto")
    assert info.config["workdir"] == "/" and info.config["user"] == "root"
    mnt = images.mounts.acquire(info.layers[0])
    try:
        st = (mnt / "usr/bin/fine").stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (42, 43, 0o755)
        assert st.st_mtime_ns == MTIME_NS
        assert (mnt / "usr").stat().st_mtime_ns == 1_400_000_000 * 10**9
        assert os.readlink(mnt / "usr/bin/alias") == "fine"
        assert (mnt / "usr/bin/hard").stat().st_ino == st.st_ino
        assert stat.S_IMODE((mnt / "tmp").stat().st_mode) == 0o1777
    finally:
        images.mounts.release(info.layers[0])

    # The same bytes again: the layer is reused, not rebuilt.
    t0 = time.perf_counter()
    again = await images.import_archive("rootfs:again", _chunks(data))
    assert again.layers == info.layers and again.digest == info.digest
    assert time.perf_counter() - t0 < 1.0


def _layers() -> tuple[bytes, bytes]:
    """Two layers: the upper deletes etc/gone and makes opq/ opaque."""
    lower = _tar(
        [
            _dir("etc"),
            _file("etc/keep", b"keep"),
            _file("etc/gone", b"gone"),
            _dir("opq"),
            _file("opq/old1", b"old"),
            _dir("opq/sub"),
            _file("opq/sub/old2", b"old"),
        ]
    )
    upper = _tar(
        [
            _dir("etc"),
            _file("etc/.wh.gone", b""),
            _dir("opq"),
            # Same-layer content listed before the opaque marker must survive it.
            _file("opq/new", b"new"),
            _file("opq/.wh..wh..opq", b""),
            _file("etc/added", b"added", uid=1000, gid=1000),
        ]
    )
    return lower, upper


IMAGE_CONFIG = {
    "architecture": "amd64",
    "os": "linux",
    "config": {
        "Env": ["PATH=/opt/bin:/usr/bin", "FOO=bar=baz"],
        "WorkingDir": "/work",
        "User": "1000",
    },
    "rootfs": {"type": "layers", "diff_ids": []},
}


def _check_layered(mnt: Path, info: ImageInfo) -> None:
    assert (mnt / "etc/keep").read_text() == "keep"
    assert not (mnt / "etc/gone").exists()
    assert not (mnt / "etc/.wh.gone").exists()
    assert (mnt / "etc/added").stat().st_uid == 1000
    assert sorted(p.name for p in (mnt / "opq").iterdir()) == ["new"]
    assert info.config["env"] == {"PATH": "/opt/bin:/usr/bin", "FOO": "bar=baz"}
    assert info.config["workdir"] == "/work"
    assert info.config["user"] == "1000"


async def test_import_docker_save_archive(images: Images) -> None:
    lower, upper = _layers()
    config = json.dumps(IMAGE_CONFIG).encode()
    manifest = [
        {
            "Config": "cfg.json",
            "RepoTags": ["two:layers"],
            "Layers": ["l1/layer.tar", "l2/layer.tar"],
        }
    ]
    archive = _tar(
        [
            _dir("l1"),
            _file("l1/layer.tar", lower),
            _dir("l2"),
            # docker save links a layer it already wrote under another id
            _link("l2/layer.tar", "../l2real/layer.tar"),
            _dir("l2real"),
            _file("l2real/layer.tar", upper),
            _file("cfg.json", config),
            _file("manifest.json", json.dumps(manifest).encode()),
        ]
    )
    info = await images.import_archive("docker:save", _chunks(archive))
    mnt = images.mounts.acquire(info.layers[0])
    try:
        _check_layered(mnt, info)
    finally:
        images.mounts.release(info.layers[0])


def _blob(data: bytes) -> tuple[str, tuple[tarfile.TarInfo, bytes]]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return digest, _file(f"blobs/sha256/{digest[7:]}", data)


def _oci_archive(*, tamper: bool = False) -> bytes:
    lower, upper = _layers()
    upper_gz = gzip.compress(upper)
    d_lower, b_lower = _blob(lower)
    d_upper, b_upper = _blob(upper_gz)
    d_cfg, b_cfg = _blob(json.dumps(IMAGE_CONFIG).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": d_cfg},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d_lower},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d_upper},
        ],
    }
    d_man, b_man = _blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": d_man,
                "platform": {"os": "linux", "architecture": "amd64"},
            }
        ],
    }
    if tamper:
        b_lower = (b_lower[0], b_lower[1][:-1] + b"\x01")
    return _tar(
        [
            _file("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            _file("index.json", json.dumps(index).encode()),
            _dir("blobs"),
            _dir("blobs/sha256"),
            b_lower,
            b_upper,
            b_cfg,
            b_man,
        ]
    )


async def test_import_oci_layout_archive(images: Images) -> None:
    info = await images.import_archive("oci:layout", _chunks(_oci_archive()), fmt="oci")
    mnt = images.mounts.acquire(info.layers[0])
    try:
        _check_layered(mnt, info)
    finally:
        images.mounts.release(info.layers[0])
    with pytest.raises(ImageBuildError, match="does not match its digest"):
        await images.import_archive("oci:tampered", _chunks(_oci_archive(tamper=True)))
    with pytest.raises(ImageBuildError, match="not an OCI archive"):
        await images.import_archive("oci:plain", _chunks(_tar([_dir("etc")])), fmt="oci")


@pytest.mark.parametrize(
    "entries",
    [
        [_file("../evil", b"x")],
        [_file("/abs", b"x")],
        [_dir("a"), _file("a/../../evil", b"x")],
        [_dir("a"), _link("a/up", "../../outside")],
        [_link("up", "..")],
        [_file("x", b"x"), _link("h", "../x", hard=True)],
        [_link("h", "/etc/passwd", hard=True)],
    ],
    ids=[
        "dotdot",
        "absolute",
        "nested-dotdot",
        "symlink-out",
        "symlink-dotdot",
        "hard-dotdot",
        "hard-abs",
    ],
)
async def test_path_traversal_rejected(
    images: Images, entries: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    with pytest.raises(InvalidArgument):
        await images.import_archive("evil:x", _chunks(_tar(entries)))
    with pytest.raises(ImageNotFound):
        await images.resolve("evil:x")
    assert list((images.root / "tmp").iterdir()) == []


async def test_symlinks_resolve_inside_the_tree(images: Images, tmp_path: Path) -> None:
    """A symlink to an absolute host path followed by a write through it lands in the
    image, never on the host."""
    outside = tmp_path / "outside"
    outside.mkdir()
    entries = [_link("esc", str(outside)), _file("esc/pwned", b"x")]
    info = await images.import_archive("inside:x", _chunks(_tar(entries)))
    assert not (outside / "pwned").exists()
    mnt = images.mounts.acquire(info.layers[0])
    try:
        assert (mnt / str(outside).lstrip("/") / "pwned").read_bytes() == b"x"
    finally:
        images.mounts.release(info.layers[0])


# -- integrity --


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_corrupt_blob_is_never_mounted(images: Images, tmp_path: Path, damage: str) -> None:
    src = tmp_path / "src"
    _sample_tree(src)
    info = await images.import_directory("fragile:1", src)
    digest = info.layers[0]
    blob = images.layer_path(digest)
    _damage(blob, damage)
    with pytest.raises(CorruptBlob, match="corrupt"):
        images.mounts.acquire(digest)
    assert not images.mounts.is_mounted(digest)
    assert _mount_count(images.mounts.mount_point(digest)) == 0
    with pytest.raises(CorruptBlob):
        images.layer_path(digest)
    with pytest.raises(CorruptBlob):
        await images.verify("fragile:1")


# -- the host mount cache --


async def test_mount_refcount_and_adopt_after_restart(
    images: Images, engine: AsyncEngine, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    _sample_tree(src)
    info = await images.import_directory("shared:1", src)
    digest = info.layers[0]
    t0 = time.perf_counter()
    p1 = images.mounts.acquire(digest)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    p2 = images.mounts.acquire(digest)
    second = time.perf_counter() - t0
    print(f"\nlayer acquire: first (mount) {first * 1000:.3f} ms, cached {second * 1000:.4f} ms")
    assert p1 == p2 and images.mounts.refcount(digest) == 2
    assert _mount_count(p1) == 1
    images.mounts.release(digest)
    assert images.mounts.refcount(digest) == 1
    assert images.mounts.unmount_unused() == []  # still in use

    # Simulated crash: a new process image over the same directory and database.
    again = Images(images.root, engine)
    await again.open()
    assert again.mounts.is_mounted(digest) and again.mounts.refcount(digest) == 0
    assert again.mounts.acquire(digest) == p1
    assert _mount_count(p1) == 1  # reused, not mounted twice
    # A duplicate stacked by a racing earlier run is trimmed on adoption.
    linux.mount(again.store.path(digest), p1, "erofs", linux.MS_RDONLY)
    assert _mount_count(p1) == 2
    third = Images(images.root, engine)
    await third.open()
    assert _mount_count(p1) == 1
    again.mounts.release(digest)
    await third.close()
    await again.close()
    assert _mount_count(p1) == 0


async def test_a_mount_made_for_a_cancelled_caller_is_released(
    images: Images, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acquire_async (the FnCall pool's way to mount its layers): cancelled while the
    worker thread mounts, the layer ends with no user counted, so it can be unmounted."""
    src = tmp_path / "src"
    _sample_tree(src)
    digest = (await images.import_directory("cancelled:1", src)).layers[0]
    go = threading.Event()
    real = images.mounts.acquire

    def slow(d: str, *, holder: str | None = None) -> Path:
        go.wait(5)
        return real(d, holder=holder)

    monkeypatch.setattr(images.mounts, "acquire", slow)
    task = asyncio.ensure_future(images.mounts.acquire_async(digest))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()
    for _ in range(200):
        if images.mounts.is_mounted(digest) and images.mounts.refcount(digest) == 0:
            break
        await asyncio.sleep(0.01)
    assert images.mounts.is_mounted(digest) and images.mounts.refcount(digest) == 0
    assert images.mounts.unmount_unused() == [digest]


async def test_close_leaves_no_layer_mounted_that_nothing_live_needs(
    images: Images, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer still busy after its last user went (here: a file open in it) is detached
    at close, and with no sandbox left a layer whose user never let go is unmounted too
    and named in the log; a layer in use stays for the next run when sandboxes live on."""
    src = tmp_path / "src"
    _sample_tree(src)
    a = (await images.import_directory("busy:1", src)).layers[0]
    (src / "other").write_text("another layer")
    b = (await images.import_directory("leaked:1", src)).layers[0]
    pa, pb = images.mounts.acquire(a), images.mounts.acquire(b)
    images.mounts.release(a)
    held = os.open(pa / "etc/hello", os.O_RDONLY)  # busy: a plain umount fails with EBUSY
    try:
        images.mounts.close(busy_seconds=0.2)  # sandboxes live on: b stays
        assert _mount_count(pa) == 0 and os.read(held, 64) == b"hello\n"  # detached, readable
        assert _mount_count(pb) == 1 and images.mounts.refcount(b) == 1
    finally:
        os.close(held)
    with caplog.at_level(logging.WARNING, logger="dsec.images.mounts"):
        images.mounts.close(nothing_live=True)
    assert _mount_count(pb) == 0 and not images.mounts.mounted()
    assert any(b in r.getMessage() for r in caplog.records), caplog.records


def _take(mounts: LayerMounts, digest: str) -> None:
    mounts.acquire(digest)


def _give_back(mounts: LayerMounts, digest: str) -> None:
    mounts.release(digest)


async def test_a_user_that_never_lets_go_is_named_by_its_call_site(
    images: Images,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the tracer on (the tests' platforms), the close that finds a layer still
    counted as used names where it was taken and where it was given back."""
    monkeypatch.setenv(TRACE_USERS_ENV, "1")
    src = tmp_path / "src"
    _sample_tree(src)
    digest = (await images.import_directory("traced:1", src)).layers[0]
    mounts = LayerMounts(images.mounts.root, images.store)
    for _ in range(3):
        _take(mounts, digest)
    for _ in range(2):
        _give_back(mounts, digest)
    with caplog.at_level(logging.WARNING, logger="dsec.images.mounts"):
        mounts.close(nothing_live=True)
    said = [r.getMessage() for r in caplog.records]
    assert any("+3 at " in m and "_take" in m for m in said), said
    assert any("-2 at " in m and "_give_back" in m for m in said), said
    assert not mounts.mounted()


async def test_a_holder_that_never_lets_go_is_named_with_where_it_took_the_layer(
    images: Images,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Users that say who holds the layer (a sandbox id) are paired by it: the close
    names the one sandbox that kept it, and where, not every site of a busy day."""
    monkeypatch.setenv(TRACE_USERS_ENV, "1")
    src = tmp_path / "src"
    _sample_tree(src)
    digest = (await images.import_directory("held:1", src)).layers[0]
    mounts = LayerMounts(images.mounts.root, images.store)
    for sid in ("sb-a", "sb-b", "sb-c"):
        mounts.acquire(digest, holder=sid)
    for sid in ("sb-c", "sb-a"):  # in another order than taken, from another site
        _give_back_as(mounts, digest, sid)
    with caplog.at_level(logging.WARNING, logger="dsec.images.mounts"):
        mounts.close(nothing_live=True)
    said = [r.getMessage() for r in caplog.records if "held by" in r.getMessage()]
    assert len(said) == 1, said
    assert "+1 held by sb-b (acquired at " in said[0], said
    assert "test_a_holder_that_never_lets_go" in said[0], said  # where it was taken
    assert not mounts.mounted()


def _give_back_as(mounts: LayerMounts, digest: str, holder: str) -> None:
    mounts.release(digest, holder=holder)


async def test_remove_deletes_unreferenced_layers(images: Images, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _sample_tree(a)
    _sample_tree(b)
    (b / "etc/b").write_text("b")
    ia = await images.import_directory("gc:a", a)
    ib = await images.import_directory("gc:b", b)
    alias = await images.import_directory("gc:b2", b)
    assert ia.layers != ib.layers
    removed = await images.remove("gc:a")
    assert removed.digest == ia.digest
    assert not images.store.exists(ia.layers[0])
    assert images.store.exists(ib.layers[0])
    with pytest.raises(ImageNotFound):
        await images.resolve("gc:a")
    with pytest.raises(ImageNotFound):
        await images.remove("gc:a")

    # A mounted layer survives removal of its image until its users are gone.
    digest = ib.layers[0]
    images.mounts.acquire(digest)
    await images.remove("gc:b")
    assert images.store.exists(digest)
    images.mounts.release(digest)
    assert await images.gc() == [digest]
    assert not images.store.exists(digest)
    assert not images.mounts.is_mounted(digest)
    assert [i.ref for i in await images.list()] == [alias.ref]


async def test_resolve_unknown_image_is_helpful(images: Images, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _sample_tree(src)
    await images.import_directory("known:1", src)
    with pytest.raises(ImageNotFound) as err:
        await images.resolve("known:2")
    msg = str(err.value)
    assert "known:2 not found" in msg and "Did you mean known:1" in msg and "busybox" in msg
    assert err.value.details["known"] == ["known:1"]
    with pytest.raises(InvalidArgument):
        await images.resolve("Bad Name")
    # resolve is served from memory
    t0 = time.perf_counter()
    for _ in range(1000):
        await images.resolve("known:1")
    per_call_us = (time.perf_counter() - t0) * 1000
    print(f"\nresolve (cached): {per_call_us:.1f} us per call")
    assert per_call_us < 1000


async def test_concurrent_imports(images: Images, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _sample_tree(src)
    data = _tar([_dir("etc"), _file("etc/x", b"x")])
    results = await asyncio.gather(
        images.import_directory("race:dir", src),
        images.import_archive("race:tar1", _chunks(data)),
        images.import_archive("race:tar2", _chunks(data)),
        images.build("busybox"),
        images.build("busybox"),
    )
    assert results[3].digest == results[4].digest
    assert {i.ref for i in await images.list()} == {
        "race:dir",
        "race:tar1",
        "race:tar2",
        "busybox:latest",
    }
    for info in results:
        images.layer_path(info.layers[0])


# -- the Debian image (minutes, needs the Debian mirror) --


@pytest.fixture
def overlay_cleanup(tmp_path: Path) -> Iterator[Path]:
    work = tmp_path / "overlay"
    work.mkdir()
    try:
        yield work
    finally:
        _unmount_all(work)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_debian_python_image(images: Images, overlay_cleanup: Path) -> None:
    steps: list[str] = []
    t0 = time.perf_counter()
    info = await images.build("debian-python", progress=lambda s, d, t: steps.append(s))
    print(f"\ndebian-python first build: {time.perf_counter() - t0:.1f} s, {info.size_bytes} bytes")
    assert info.ref == "debian-python:bookworm"
    # The tree comes from debootstrap here, or from the shared build cache (tests/
    # conftest.py build_cache, kept across runs) when it was built before: one debootstrap
    # a machine and recipe version. A stamp of another recipe version would be rebuilt.
    stamp = images.build_cache / "debian-python-bookworm" / "recipe.json"
    assert any(s.startswith("debootstrap") for s in steps) or (
        "using the cached debootstrap tree" in steps
    )
    assert json.loads(stamp.read_text())["version"] == builders.DEBIAN_RECIPE_VERSION

    t0 = time.perf_counter()
    cached = await images.build("debian-python")
    assert time.perf_counter() - t0 < 1.0 and cached.digest == info.digest

    t0 = time.perf_counter()
    rebuilt = await images.build("debian-python", rebuild=True)
    print(f"debian-python rebuild from the cached tree: {time.perf_counter() - t0:.1f} s")
    assert rebuilt.layers != info.layers
    assert not images.store.exists(info.layers[0])  # the replaced layer was collected

    digest = rebuilt.layers[0]
    t0 = time.perf_counter()
    lower = images.mounts.acquire(digest)
    print(f"debian-python layer mount: {(time.perf_counter() - t0) * 1000:.2f} ms")
    try:
        # pyc files must match their sources' mtimes, or Python recompiles on start.
        src = lower / "usr/lib/python3.11/os.py"
        pyc = lower / "usr/lib/python3.11/__pycache__/os.cpython-311.pyc"
        header = pyc.read_bytes()[:16]
        assert int.from_bytes(header[4:8], "little") == 0  # timestamp-based pyc
        assert int.from_bytes(header[8:12], "little") == int(src.stat().st_mtime) & 0xFFFFFFFF
        assert src.stat().st_mtime_ns > 0

        # A throwaway overlay, as a sandbox would use it.
        upper, work, merged = (overlay_cleanup / n for n in ("upper", "work", "merged"))
        for d in (upper, work, merged):
            d.mkdir()
        linux.mount(
            "overlay", merged, "overlay", 0, f"lowerdir={lower},upperdir={upper},workdir={work}"
        )
        run = _run(["chroot", str(merged), "python3", "-c", "import sys, ssl; print(sys.version)"])
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("3.11")
        uid = _run(["chroot", str(merged), "id", "-u", "user"])
        assert uid.stdout.strip() == "1000"
        # Nothing was recompiled into the upper layer.
        assert not list(upper.rglob("*.pyc"))
        assert not list((merged / "var/cache/apt/archives").glob("*.deb"))
    finally:
        _unmount_all(overlay_cleanup)
        images.mounts.release(digest)
