"""Snapshots of graded trees: the agent's work, taken as data, never followed out.

A verify step must see the agent's files without trusting anything about them. So the
edge copies each graded path out of the agent's (frozen) merged view into a directory
of its own before the grader starts, and the grader sees only that copy, read-only:

- **Nothing is followed.** Every directory is opened with ``openat2`` and
  ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` relative to the graded root, every entry is
  looked at with ``lstat``, so no path the agent planted (a link, a link in a parent, a
  bind of ``/proc``) can take the copy anywhere else.
- **Links are inspected, not followed.** A symbolic link is kept only if the kernel
  resolves it inside its graded tree (``RESOLVE_BENEATH``); a link that would leave it
  (``/grader/expected.txt``, ``../../etc``, a loop) is left out and reported. Kept links
  resolve identically in the copy, because the copy has the same shape.
- **Only regular files, directories and links.** FIFOs (a grader reading one would
  hang), sockets and device nodes are left out and reported; set-id bits are dropped.
- **Own inodes.** A copy shares no inode and so no page cache with the agent's files:
  nothing the grader reads is visible to the agent afterwards as cache residency.
- **Bounded and iterative.** No recursion (a 100,000-deep tree is just a long list),
  bounded file count, bytes and depth; exceeding a bound fails the snapshot (fail
  closed), it never silently grades part of the work.

The copy runs in a worker thread of the edge, as root on the host, while the agent is
frozen (dsec.backends.container.verifier), so the tree cannot change under it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_OPENAT2 = 437  # x86_64 and aarch64 (the asm-generic table) alike

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08

# What a graded tree may hold before the snapshot refuses it (fail closed: the grader
# never sees part of the work). Overridable for large repositories.
MAX_FILES = int(os.environ.get("DSEC_VERIFY_MAX_FILES", "200000"))
MAX_BYTES = int(os.environ.get("DSEC_VERIFY_MAX_BYTES", str(4 << 30)))
MAX_DEPTH = 256
MAX_REFUSALS = 100  # listed in the result; the count is exact
COPY_CHUNK = 1 << 24


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """``openat2(2)``: the only way to open a path with the kernel refusing every link
    (or every escape) on the way, atomically. Raises OSError like ``os.open``."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(
        SYS_OPENAT2,
        ctypes.c_int(dir_fd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"openat2 {path}: {os.strerror(err)}")
    return int(fd)


class SnapshotTooLarge(Exception):
    """The graded tree exceeds a bound; the snapshot is not used."""


@dataclass
class Snapshot:
    """Where each graded path's copy is on the host, and what was left out."""

    copies: dict[str, Path] = field(default_factory=dict)  # path inside -> host copy
    refused: list[tuple[str, str]] = field(default_factory=list)  # (path inside, why)
    refused_count: int = 0
    files: int = 0
    bytes: int = 0

    def refuse(self, path: str, reason: str) -> None:
        self.refused_count += 1
        if len(self.refused) < MAX_REFUSALS:
            self.refused.append((path, reason))


@dataclass
class _Limits:
    files: int = MAX_FILES
    bytes: int = MAX_BYTES
    depth: int = MAX_DEPTH


def _safe_dir(dir_fd: int, rel: str) -> int:
    """A directory below ``dir_fd`` with no link anywhere on the way."""
    return openat2(
        dir_fd,
        rel or ".",
        os.O_RDONLY | os.O_DIRECTORY,
        RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS,
    )


def _link_stays_inside(root_fd: int, rel_link: str, target: str, graded: str) -> str | None:
    """None if the link at ``rel_link`` (relative to the graded root) resolves inside
    the graded tree, else why not. Absolute targets inside the graded path are checked
    as the same path relative to its root (the copy sits at the same place)."""
    if target.startswith("/"):
        if target != graded and not target.startswith(graded.rstrip("/") + "/"):
            return f"link to {target} leaves the graded tree {graded}"
        probe = target[len(graded) :].lstrip("/") or "."
    else:
        probe = rel_link
    try:
        fd = openat2(root_fd, probe, os.O_PATH, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None  # dangling inside the tree: harmless, kept as it is
        if exc.errno == errno.EXDEV:
            return f"link to {target} leaves the graded tree {graded}"
        if exc.errno == errno.ELOOP:
            return f"link to {target} loops"
        return f"link to {target} cannot be resolved ({os.strerror(exc.errno or 0)})"
    os.close(fd)
    return None


def _copy_file(
    src_dir: int, dst_dir: int, name: str, st: os.stat_result, dst_name: str | None = None
) -> int:
    """Copy one regular file (the kernel moves the bytes); returns bytes copied."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_dir)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):  # swapped between lstat and open
            raise OSError(errno.EINVAL, f"{name} is no longer a regular file")
        dst = os.open(
            dst_name or name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dst_dir,
        )
        try:
            copied = _copy_bytes(src, dst)
            os.fchown(dst, st.st_uid, st.st_gid)
            os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)  # no set-id, no sticky
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return copied


def _copy_bytes(src: int, dst: int) -> int:
    total = 0
    use_cfr = True
    while True:
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, COPY_CHUNK)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
                continue
        else:
            n = os.sendfile(dst, src, None, COPY_CHUNK)
        if n == 0:
            return total
        total += n


def _finish_dir(fd: int, st: os.stat_result) -> None:
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o1777)


def _copy_tree(root_fd: int, dst_root: int, graded: str, snap: Snapshot, limits: _Limits) -> None:
    """Copy the directory ``root_fd`` into ``dst_root``, iteratively."""
    pending: list[tuple[str, int]] = [("", 0)]  # (path relative to the root, depth)
    finished: list[tuple[str, os.stat_result]] = []  # modes set last: dirs may be 0555
    while pending:
        rel, depth = pending.pop()
        src = _safe_dir(root_fd, rel)
        try:
            dst = _safe_dir(dst_root, rel)
            try:
                with os.scandir(src) as it:
                    entries = [e.name for e in it]
                for name in entries:
                    child = f"{rel}/{name}" if rel else name
                    inside = f"{graded}/{child}"
                    snap.files += 1
                    if snap.files > limits.files:
                        raise SnapshotTooLarge(f"more than {limits.files} entries under {graded}")
                    try:
                        st = os.stat(name, dir_fd=src, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    mode = st.st_mode
                    if stat.S_ISDIR(mode):
                        if depth + 1 > limits.depth:
                            raise SnapshotTooLarge(
                                f"{graded} is nested deeper than {limits.depth} directories"
                            )
                        os.mkdir(name, 0o700, dir_fd=dst)
                        pending.append((child, depth + 1))
                        finished.append((child, st))
                    elif stat.S_ISREG(mode):
                        if snap.bytes + st.st_size > limits.bytes:
                            raise SnapshotTooLarge(f"more than {limits.bytes} bytes under {graded}")
                        snap.bytes += _copy_file(src, dst, name, st)
                    elif stat.S_ISLNK(mode):
                        target = os.readlink(name, dir_fd=src)
                        why = _link_stays_inside(root_fd, child, target, graded)
                        if why is None:
                            os.symlink(target, name, dir_fd=dst)
                        else:
                            snap.refuse(inside, why)
                    else:
                        snap.refuse(inside, f"not a file, directory or link ({_kind(mode)})")
            finally:
                os.close(dst)
        finally:
            os.close(src)
    for rel, st in reversed(finished):
        fd = _safe_dir(dst_root, rel)
        try:
            _finish_dir(fd, st)
        finally:
            os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def snapshot(
    view: Path,
    graded: list[str],
    dest: Path,
    *,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Snapshot:
    """Copy each graded path of the tree rooted at ``view`` (the agent's merged, frozen
    view) into ``dest/<i>``. Paths that do not exist are skipped (not in ``copies``);
    a graded path that is itself a link, or has a link among its parents, is refused.
    Raises SnapshotTooLarge past a bound (``dest`` is then left for the caller to
    remove)."""
    limits = _Limits(max_files, max_bytes, max_depth)
    snap = Snapshot()
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    view_fd = os.open(view, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    dest_fd = os.open(dest, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, path in enumerate(graded):
            if _snapshot_one(view_fd, dest_fd, path, str(i), snap, limits):
                snap.copies[path] = dest / str(i)
    finally:
        os.close(view_fd)
        os.close(dest_fd)
    return snap


def _snapshot_one(
    view_fd: int, dest_fd: int, path: str, slot: str, snap: Snapshot, limits: _Limits
) -> bool:
    """Copy one graded path to ``dest/slot``; False if it is absent or refused."""
    rel = path.lstrip("/")
    parent, _, name = rel.rpartition("/")
    try:
        parent_fd = _safe_dir(view_fd, parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # RESOLVE_NO_SYMLINKS met a link
            snap.refuse(path, "a parent directory of the graded path is a link")
        elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            snap.refuse(path, f"cannot open its parent ({os.strerror(exc.errno or 0)})")
        return False
    try:
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            snap.refuse(path, "the graded path itself is a link")
            return False
        if stat.S_ISREG(st.st_mode):
            if st.st_size > limits.bytes:
                raise SnapshotTooLarge(f"{path} is larger than {limits.bytes} bytes")
            dst_fd = _safe_dir(dest_fd, "")
            try:
                snap.bytes += _copy_file(parent_fd, dst_fd, name, st, dst_name=slot)
            finally:
                os.close(dst_fd)
            snap.files += 1
            return True
        if not stat.S_ISDIR(st.st_mode):
            snap.refuse(path, f"the graded path is a {_kind(st.st_mode)}")
            return False
        os.mkdir(slot, 0o700, dir_fd=dest_fd)
        root_fd = _safe_dir(parent_fd, name)
        dst_root = _safe_dir(dest_fd, slot)
        try:
            _copy_tree(root_fd, dst_root, path, snap, limits)
            _finish_dir(dst_root, st)
        finally:
            os.close(root_fd)
            os.close(dst_root)
        return True
    finally:
        os.close(parent_fd)
