"""Registry layer fidelity without a registry: the converter's xattr, device node and
lower-hard-link rules on hand-made hostile tars (dsec.images.difftar, oci.lower)."""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
from pathlib import Path

import pytest

from dsec.errors import InvalidArgument, LimitExceeded
from dsec.images.difftar import REGISTRY_XATTRS, capability_v2, write_diff_tree
from dsec.images.oci.lower import lookup_in
from tests.oci_registry import CAP_NET_RAW_V2, CAP_NET_RAW_V3

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="mknod, chown and trusted xattrs need root"),
]


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _file(name: str, xattrs: dict[str, bytes] | None = None) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = 0o755
    info.pax_headers = {
        f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape") for k, v in (xattrs or {}).items()
    }
    return info, b"data"


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info, None


def test_capabilities_and_xattrs(tmp_path: Path) -> None:
    assert capability_v2(CAP_NET_RAW_V3) == CAP_NET_RAW_V2
    for bad in (b"", CAP_NET_RAW_V2[:19], struct.pack("<IIIII", 0x05000000, 1, 0, 0, 0)):
        assert capability_v2(bad) is None
    stream = _tar(
        _file("caps", {"security.capability": CAP_NET_RAW_V2, "user.a": b"1"}),
        _file("badcaps", {"security.capability": b"\x01\x02\x03"}),
        _file(
            "overlay",
            {"trusted.overlay.redirect": b"/etc", "trusted.overlay.metacopy": b"", "user.b": b"2"},
        ),
        _file("selinux", {"security.selinux": b"system_u:object_r:shadow_t:s0"}),
        _file("huge", {"user.big": b"x" * (65 << 10)}),
    )
    result = write_diff_tree(
        stream, tmp_path / "t", excluded=(), max_bytes=1 << 20, xattrs=REGISTRY_XATTRS
    )
    got = {
        name: {
            x: os.getxattr(tmp_path / "t" / name, x) for x in os.listxattr(tmp_path / "t" / name)
        }
        for name in ("caps", "badcaps", "overlay", "selinux", "huge")
    }
    assert got["caps"] == {"security.capability": CAP_NET_RAW_V2, "user.a": b"1"}
    assert got["overlay"] == {"user.b": b"2"}
    assert got["badcaps"] == got["selinux"] == got["huge"] == {}
    assert result.xattrs == 3 and result.xattrs_dropped == 5
    with pytest.raises(ValueError, match="trusted"):
        write_diff_tree(_tar(), tmp_path / "u", excluded=(), max_bytes=1, xattrs=("trusted.",))
    # a sandbox's packed diff (no allow-list) keeps no archive xattr at all
    plain = write_diff_tree(
        _tar(_file("caps", {"security.capability": CAP_NET_RAW_V2})),
        tmp_path / "v",
        excluded=(),
        max_bytes=1 << 20,
    )
    assert os.listxattr(tmp_path / "v" / "caps") == [] and plain.xattrs_dropped == 1


def test_device_nodes_are_left_out_with_a_reason(tmp_path: Path) -> None:
    members = []
    for name, kind in (("c", tarfile.CHRTYPE), ("b", tarfile.BLKTYPE)):
        info = tarfile.TarInfo(f"dev/{name}")
        info.type, info.devmajor, info.devminor = kind, 1, 3
        members.append((info, None))
    result = write_diff_tree(_tar(*members), tmp_path / "t", excluded=(), max_bytes=1)
    assert result.skipped == [
        "dev/c (character device: not part of a layer)",
        "dev/b (block device: not part of a layer)",
    ]
    assert not (tmp_path / "t" / "dev" / "c").exists()


def _lower_tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "file").write_text("lower\n")
    os.chown(root / "etc" / "file", 7, 8)
    (root / "etc" / "file").chmod(0o4750)
    os.setxattr(root / "etc" / "file", "security.capability", CAP_NET_RAW_V2)
    os.setxattr(root / "etc" / "file", "trusted.overlay.origin", b"x")
    return root


def test_hard_links_to_a_lower_file_are_copied_up(tmp_path: Path) -> None:
    low = _lower_tree(tmp_path / "low")

    def lower(parts: list[str]) -> str | None:
        return lookup_in([str(low)], parts)

    result = write_diff_tree(
        _tar(_link("bin/a", "etc/file"), _link("bin/b", "etc/file")),
        tmp_path / "t",
        excluded=(),
        max_bytes=1 << 20,
        xattrs=REGISTRY_XATTRS,
        lower=lower,
    )
    t = tmp_path / "t"
    st = os.lstat(t / "etc" / "file")
    assert result.lower_links == 1 and st.st_nlink == 3
    assert (t / "bin" / "a").read_text() == "lower\n"
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (7, 8, 0o4750)
    assert os.listxattr(t / "etc" / "file") == ["security.capability"]
    # a link to nothing below, or bigger than the layer's bound, is refused
    with pytest.raises(InvalidArgument, match="missing file"):
        write_diff_tree(
            _tar(_link("x", "etc/none")), tmp_path / "u", excluded=(), max_bytes=1, lower=lower
        )
    with pytest.raises(LimitExceeded):
        write_diff_tree(
            _tar(_link("x", "etc/file")), tmp_path / "w", excluded=(), max_bytes=3, lower=lower
        )
    assert not (tmp_path / "u").exists() and not (tmp_path / "w").exists()


def test_lower_lookup_follows_overlay_rules(tmp_path: Path) -> None:
    """Top first; a whiteout deletes, an opaque directory hides what is below, a
    symlinked or non-directory parent is never followed, only regular files count."""
    low = _lower_tree(tmp_path / "low")
    (low / "dir").mkdir()
    (low / "dir" / "f").write_text("f")
    (low / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(low / "fifo")
    mid = tmp_path / "mid"
    (mid / "etc").mkdir(parents=True)
    os.mknod(mid / "etc" / "file", stat.S_IFCHR | 0o600, 0)  # whiteout
    (mid / "dir").mkdir()
    os.setxattr(mid / "dir", "trusted.overlay.opaque", b"y")
    (mid / "evil").symlink_to(low / "etc")
    roots = [str(mid), str(low)]
    assert lookup_in(roots, ["etc", "file"]) is None
    assert lookup_in([str(low)], ["etc", "file"]) == str(low / "etc" / "file")
    assert lookup_in(roots, ["dir", "f"]) is None
    assert lookup_in(roots, ["evil", "file"]) is None
    assert lookup_in(roots, ["fifo"]) is None
    assert lookup_in(roots, ["etc"]) is None
