"""dsec.images.difftar on hostile tars: a packer VM's stream is as hostile as the agent's
disk, so each attack here must be refused or defused without writing outside the tree."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec.errors import InvalidArgument, LimitExceeded
from dsec.images.difftar import OPAQUE_XATTR, write_diff_tree

pytestmark = pytest.mark.root

Member = tuple[tarfile.TarInfo, bytes | None]


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: object) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = len(data) if kind == tarfile.REGTYPE else 0
    ti.mode = 0o644 if kind != tarfile.DIRTYPE else 0o755
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data if kind == tarfile.REGTYPE else None


def tar_of(*members: Member) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., Path]:
    def run(*members: Member, excluded: tuple[str, ...] = (), max_bytes: int = 1 << 30) -> Path:
        root = tmp_path / "tree"
        write_diff_tree(tar_of(*members), root, excluded=excluded, max_bytes=max_bytes)
        return root

    return run


def test_whiteouts_and_opaque_dirs_become_overlay_form(
    write: Callable[..., Path], tmp_path: Path
) -> None:
    root = write(
        member("etc/", tarfile.DIRTYPE),
        member("etc/.wh.passwd"),
        member("usr/", tarfile.DIRTYPE),
        member("usr/.wh..wh..opq"),
        member("usr/new", data=b"n", uid=1234, gid=5678, mode=0o4755, mtime=1_700_000_000),
    )
    wh = os.lstat(root / "etc/passwd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(root / "usr", OPAQUE_XATTR) == b"y"
    st = os.lstat(root / "usr/new")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o4755)
    assert int(st.st_mtime) == 1_700_000_000
    assert not (root / "usr/.wh..wh..opq").exists() and not (root / "etc/.wh.passwd").exists()


@pytest.mark.parametrize(
    "name", ["../escape", "/etc/escape", "a/../../escape", "x" * 120 + "\x00b"]
)
def test_names_that_leave_the_tree_are_refused(
    write: Callable[..., Path], tmp_path: Path, name: str
) -> None:
    with pytest.raises(InvalidArgument):
        write(member(name, data=b"x"))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "tree").exists()


def test_nothing_is_written_through_a_symlink(write: Callable[..., Path], tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(InvalidArgument, match="non-directory"):
        write(
            member("l", tarfile.SYMTYPE, linkname=str(outside)),
            member("l/planted", data=b"x"),
        )
    assert list(outside.iterdir()) == []
    # ... nor through a symlink the archive puts where a directory was
    with pytest.raises(InvalidArgument):
        write(
            member("d/", tarfile.DIRTYPE),
            member("d", tarfile.SYMTYPE, linkname=str(outside)),
            member("d/planted", data=b"x"),
        )
    assert list(outside.iterdir()) == []


def test_device_nodes_are_left_out_fifos_and_links_kept(write: Callable[..., Path]) -> None:
    root = write(
        member("sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
        member("mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
        member("zero", tarfile.CHRTYPE, devmajor=0, devminor=0),  # not our whiteout form
        member("fifo", tarfile.FIFOTYPE),
        member("a", data=b"twin"),
        member("b", tarfile.LNKTYPE, linkname="a"),
        member("s", tarfile.SYMTYPE, linkname="/etc/shadow"),  # data: never followed
    )
    assert sorted(os.listdir(root)) == ["a", "b", "fifo", "s"]
    assert stat.S_ISFIFO(os.lstat(root / "fifo").st_mode)
    assert os.lstat(root / "b").st_ino == os.lstat(root / "a").st_ino
    assert os.readlink(root / "s") == "/etc/shadow"


def test_xattrs_of_the_archive_are_never_applied(write: Callable[..., Path]) -> None:
    hostile = {
        "SCHILY.xattr.trusted.overlay.redirect": "/grader",
        "SCHILY.xattr.trusted.overlay.metacopy": "",
        "SCHILY.xattr.security.capability": "x",
    }
    root = write(member("d/", tarfile.DIRTYPE, pax_headers=hostile))
    assert os.listxattr(root / "d") == []


@pytest.mark.parametrize("target", ["../../etc/passwd", "missing", "dir", "/etc/passwd"], ids=str)
def test_hard_links_only_to_files_of_the_archive(write: Callable[..., Path], target: str) -> None:
    with pytest.raises(InvalidArgument):
        write(member("dir/", tarfile.DIRTYPE), member("h", tarfile.LNKTYPE, linkname=target))


def test_excluded_paths_are_dropped_with_links_into_them(write: Callable[..., Path]) -> None:
    root = write(
        member("grader/", tarfile.DIRTYPE),
        member("grader/answer", data=b"planted"),
        member("h", tarfile.LNKTYPE, linkname="grader/answer"),
        member("keep", data=b"k"),
        excluded=("/grader",),
    )
    assert sorted(os.listdir(root)) == ["keep"]


def test_too_much_data_is_a_typed_error_and_leaves_nothing(
    write: Callable[..., Path], tmp_path: Path
) -> None:
    with pytest.raises(LimitExceeded):
        write(member("a", data=b"x" * 4096), member("b", data=b"x" * 4096), max_bytes=6000)
    assert not (tmp_path / "tree").exists()


@pytest.mark.parametrize("name", [".wh..", ".wh.", "d/.wh..wh.plnk"])
def test_malformed_whiteouts_are_refused(write: Callable[..., Path], name: str) -> None:
    with pytest.raises(InvalidArgument):
        write(member(name))


def test_garbage_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        write_diff_tree(
            io.BytesIO(os.urandom(4096)), tmp_path / "tree", excluded=(), max_bytes=1 << 20
        )
    assert not (tmp_path / "tree").exists()
