"""A hostile tar of a sandbox's changes, turned into an overlay upper tree for mkfs.erofs.

A microVM's changes reach the host as a tar a packer VM wrote (dsec.backends.microvm.
pack): its guest kernel parsed the agent's disk, so the stream is as hostile as the disk.
Unlike an image layer (dsec.images.extract.TreeWriter, which applies whiteouts against
the layers below) a packed diff must *keep* its deletions, in the form overlayfs reads
in a lower layer: ``.wh.<name>`` becomes a whiteout (char device 0/0) and
``.wh..wh..opq`` the ``trusted.overlay.opaque`` xattr of its directory. So the writer
starts from an empty directory and refuses anything that could reach outside it or make
the layer more than files:

* names: no absolute paths, no ``..`` (``split_member_name``), no NUL; every parent
  component must be a real directory in the tree (never a symlink: nothing is followed),
  created as 0755 root when the archive did not name it first;
* types: directories, regular files, symlinks, FIFOs, hard links to a regular file the
  archive already wrote; device nodes and anything else are left out and counted;
* metadata: numeric owner, mode (setuid kept, as in a container's upper), nanosecond
  mtime; **no xattr** of the archive is applied unless the caller names it in
  ``xattrs`` (a crafted ``trusted.overlay.redirect`` or ``metacopy`` would redirect
  lookups in the layer; ``trusted.*`` can never be named). A registry layer keeps
  ``security.capability`` (file capabilities, e.g. ping's ``cap_net_raw``; a v3 value
  with a namespace root id is stored as v2, which every mount honours the same way) and
  ``user.*``; a sandbox's packed diff keeps none;
* hard links: to a file the archive already wrote, or (registry layers, ``lower``)
  to a file of a layer below, which OCI allows: that file is copied up into this layer
  first with its owner, mode, mtime and kept xattrs (what overlayfs itself does when a
  lower file is linked), and the link made to the copy (``DiffTree.lower_links``);
* bounds: at most ``MAX_ENTRIES`` members and ``max_bytes`` of file data (the caller's
  disk limit), or the pack fails with a typed error and the tree is removed.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dsec.errors import InvalidArgument, LimitExceeded
from dsec.images.extract import OPAQUE, WHITEOUT, forget_members, mtime_ns, split_member_name

CHUNK = 1 << 20
MAX_ENTRIES = 2_000_000
OPAQUE_XATTR = "trusted.overlay.opaque"
CAPABILITY_XATTR = "security.capability"
REGISTRY_XATTRS = (CAPABILITY_XATTR, "user.")  # names, or prefixes ending in "."
MAX_XATTR_BYTES = 64 << 10
_CAP_V2, _CAP_V3 = 0x02000000, 0x03000000

# A file of a layer below, by path components: its host path, or None when absent.
LowerLookup = Callable[[list[str]], str | None]


def capability_v2(raw: bytes) -> bytes | None:
    """A ``security.capability`` value as VFS_CAP_REVISION_2 (20 bytes), or None when
    it is neither v2 nor v3: the v3 root id only scopes the caps to a user namespace."""
    if len(raw) not in (20, 24):
        return None
    (magic,) = struct.unpack_from("<I", raw)
    revision, flags = magic & 0xFF000000, magic & 0x00FFFFFF
    if flags & ~1 or (revision, len(raw)) not in ((_CAP_V2, 20), (_CAP_V3, 24)):
        return None
    return struct.pack("<I", _CAP_V2 | flags) + raw[4:20]


@dataclass
class DiffTree:
    """What ``write_diff_tree`` wrote: entries kept, and what it left out and why."""

    entries: int = 0
    skipped: list[str] = field(default_factory=list)  # "name (why)"
    excluded: list[str] = field(default_factory=list)
    xattrs: int = 0  # archive xattrs applied
    xattrs_dropped: int = 0  # archive xattrs not allowed (or malformed)
    lower_links: int = 0  # hard links to a file of a layer below, copied up


def _under(parts: list[str], excluded: Sequence[list[str]]) -> bool:
    return any(parts[: len(e)] == e for e in excluded)


class _Writer:
    def __init__(
        self,
        root: Path,
        excluded: Sequence[str],
        max_bytes: int,
        xattrs: Sequence[str] = (),
        lower: LowerLookup | None = None,
    ) -> None:
        self.root = root
        if any(x.startswith("trusted.") or not x for x in xattrs):
            raise ValueError("trusted.* xattrs are never taken from an archive")
        self.xattrs = tuple(xattrs)
        self.lower = lower
        self.excluded = [split_member_name(e.lstrip("/"), "excluded path") for e in excluded]
        self.max_bytes = max_bytes
        self.data = 0
        self.result = DiffTree()
        self.dir_times: dict[str, int] = {}

    def host(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts)

    def parent_dir(self, parts: list[str], name: str) -> str:
        """The host path of the directory ``parts``, every component a real directory
        (made when missing), never followed through a link."""
        path = os.fspath(self.root)
        for part in parts:
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise InvalidArgument(f"packed member {name!r} is below a non-directory")
        return path

    def add(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = split_member_name(m.name, "packed member")
        if not parts:
            return  # the root itself: its metadata is the layer below's
        if _under(parts, self.excluded):
            self.result.excluded.append("/" + "/".join(parts))
            return
        base = parts[-1]
        parent = self.parent_dir(parts[:-1], m.name)
        if base == OPAQUE:
            os.setxattr(parent, OPAQUE_XATTR, b"y", follow_symlinks=False)
            self.result.entries += 1
            return
        if base.startswith(WHITEOUT):
            target = base.removeprefix(WHITEOUT)
            if target in ("", ".", "..") or target.startswith(WHITEOUT):
                raise InvalidArgument(f"invalid whiteout {m.name!r} in a packed diff")
            self._replace(os.path.join(parent, target))
            os.mknod(os.path.join(parent, target), stat.S_IFCHR | 0o600, 0)
            self.result.entries += 1
            return
        path = os.path.join(parent, base)
        if m.isdir():
            try:
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode):
                    self._replace(path)
                    os.mkdir(path, 0o700)
            except FileNotFoundError:
                os.mkdir(path, 0o700)
            self._meta(path, m)
            self.dir_times[path] = mtime_ns(m)
        elif m.isreg():
            self._replace(path)
            self._write(tf, m, path)
            self._meta(path, m)
        elif m.issym():
            if not m.linkname or "\x00" in m.linkname:
                raise InvalidArgument(f"symlink {m.name!r} has an empty target")
            self._replace(path)
            os.symlink(m.linkname, path)  # kept as data: never followed here
            self._meta(path, m)
        elif m.islnk():
            target_parts = split_member_name(m.linkname, "hard link target")
            if not target_parts or _under(target_parts, self.excluded):
                self.result.skipped.append(m.name)
                return
            target = os.path.join(self.parent_dir(target_parts[:-1], m.name), target_parts[-1])
            try:
                tst = os.lstat(target)
            except FileNotFoundError:
                tst = self._copy_up(target_parts, target, m.name)
            if not stat.S_ISREG(tst.st_mode):
                raise InvalidArgument(f"hard link {m.name!r} to a non-file")
            if target != path:
                self._replace(path)
                os.link(target, path, follow_symlinks=False)
        elif m.isfifo():
            self._replace(path)
            os.mkfifo(path, 0o600)
            self._meta(path, m)
        else:  # never a device node from an archive: a sandbox must not reach one
            kind = "character device" if m.ischr() else "block device" if m.isblk() else "other"
            self.result.skipped.append(f"{m.name} ({kind}: not part of a layer)")
            return
        self.result.entries += 1

    def _copy_up(self, parts: list[str], target: str, name: str) -> os.stat_result:
        """The hard link target ``parts`` from a layer below, copied into this tree."""
        src = self.lower(parts) if self.lower is not None else None
        if src is None:
            raise InvalidArgument(f"hard link {name!r} to a missing file")
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb", closefd=True) as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"hard link {name!r} to a non-file")
            self.data += st.st_size
            if self.data > self.max_bytes:
                raise LimitExceeded(
                    f"the layer exceeds {self.max_bytes // (1 << 20)} MiB",
                    limit_mb=self.max_bytes // (1 << 20),
                )
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with open(os.open(target, flags, 0o600), "wb", closefd=True) as out:
                shutil.copyfileobj(fh, out, CHUNK)
            os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
            os.chmod(target, stat.S_IMODE(st.st_mode))
            for xname in os.listxattr(fh.fileno()):
                if self._allowed(xname):
                    os.setxattr(target, xname, os.getxattr(fh.fileno(), xname))
            os.utime(target, ns=(st.st_mtime_ns, st.st_mtime_ns), follow_symlinks=False)
        self.result.lower_links += 1
        return os.lstat(target)

    def _allowed(self, name: str) -> bool:
        return any(name == x or (x.endswith(".") and name.startswith(x)) for x in self.xattrs)

    def _xattrs(self, path: str, m: tarfile.TarInfo) -> None:
        for key, value in m.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            name = key.removeprefix("SCHILY.xattr.")
            raw: bytes | None = value.encode("utf-8", "surrogateescape")
            if name == CAPABILITY_XATTR and raw is not None:
                raw = capability_v2(raw) if m.isreg() else None
            if raw is None or not self._allowed(name) or len(raw) > MAX_XATTR_BYTES:
                self.result.xattrs_dropped += 1
                continue
            os.setxattr(path, name, raw, follow_symlinks=False)
            self.result.xattrs += 1

    def _replace(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def _write(self, tf: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        self.data += m.size
        if self.data > self.max_bytes:
            raise LimitExceeded(
                f"the packed changes exceed {self.max_bytes // (1 << 20)} MiB",
                limit_mb=self.max_bytes // (1 << 20),
            )
        src = tf.extractfile(m)
        if src is None:
            raise InvalidArgument(f"cannot read packed member {m.name!r}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with src, open(os.open(path, flags, 0o600), "wb", closefd=True) as out:
            shutil.copyfileobj(src, out, CHUNK)

    def _meta(self, path: str, m: tarfile.TarInfo) -> None:
        os.chown(path, m.uid, m.gid, follow_symlinks=False)  # first: it clears setuid and caps
        if not m.issym():
            os.chmod(path, m.mode & 0o7777)
            self._xattrs(path, m)
        if not m.isdir():
            ns = mtime_ns(m)
            os.utime(path, ns=(ns, ns), follow_symlinks=False)


def write_diff_tree(
    stream: IO[bytes],
    root: Path,
    *,
    excluded: Sequence[str],
    max_bytes: int,
    xattrs: Sequence[str] = (),
    lower: LowerLookup | None = None,
) -> DiffTree:
    """Write the tar ``stream`` into the new directory ``root`` (see the module
    docstring); on any failure ``root`` is removed and the error raised (typed: a
    malformed stream is InvalidArgument, too much data LimitExceeded). ``xattrs``:
    archive xattr names (or ``prefix.``) to keep; ``lower``: where hard links to a
    file of a layer below are looked up (None: such a link is refused)."""
    root.mkdir(mode=0o755)
    writer = _Writer(root, excluded, max_bytes, xattrs, lower)
    try:
        with tarfile.open(fileobj=stream, mode="r|", errorlevel=2) as tf:
            for n, member in enumerate(tf):
                if n >= MAX_ENTRIES:
                    raise LimitExceeded(f"the packed changes have over {MAX_ENTRIES} entries")
                writer.add(tf, member)
                forget_members(tf)
        for path, ns in sorted(writer.dir_times.items(), key=lambda kv: -kv[0].count("/")):
            os.utime(path, ns=(ns, ns), follow_symlinks=False)
    except tarfile.TarError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise InvalidArgument(f"the packed changes are not a valid tar: {exc}") from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return writer.result
