"""Snapshots of graded trees: the agent's work, taken as data, never followed out.

A verify step must see the agent's files without trusting anything about them. So the
edge copies what the agent *changed* under each graded path (its overlay upper: files,
directories, deletions) into a directory of its own before the grader starts; the
grader sees that copy, read-only, layered over the same path of the pristine image (an
overlay inside the verifier), so a large unchanged repository costs nothing to grade:

- **Nothing is followed.** Every directory is opened with ``openat2`` and
  ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` relative to the graded root, every entry is
  looked at with ``lstat``, so no path the agent planted (a link, a link in a parent, a
  bind of ``/proc``) can take the copy anywhere else.
- **Links are inspected, not followed.** A link the agent made is kept only if the
  kernel resolves it inside its graded tree in the agent's merged view
  (``RESOLVE_BENEATH``); a link that would leave it (``/grader/expected.txt``,
  ``../../etc``, a loop) is left out (a whiteout, so nothing pristine shows through
  either) and reported. Kept links resolve identically in the verifier, whose graded
  tree has the same shape. The image's own links are the image's: trusted.
- **Only regular files, directories and links.** FIFOs (a grader reading one would
  hang), sockets and device nodes the agent made are left out and reported; set-id bits
  are dropped.
- **Own inodes for the agent's files.** A copy shares no page cache with the agent's
  file, so nothing the grader reads of the agent's work is visible to the agent as cache
  residency afterwards (pristine files are the shared read-only layers).
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
OPAQUE = "trusted.overlay.opaque"


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


@dataclass(frozen=True)
class GradedCopy:
    """One graded path on the host: ``copy`` holds what the agent changed (a file, or a
    directory with whiteouts for what it deleted); ``over_pristine`` says the verifier
    must show it layered over the pristine image's same path (else on its own)."""

    copy: Path
    over_pristine: bool


@dataclass
class Snapshot:
    """Where each graded path's copy is on the host, and what was left out."""

    copies: dict[str, GradedCopy] = field(default_factory=dict)  # path inside -> copy
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


def _try_dir(dir_fd: int, rel: str) -> int | None:
    try:
        return _safe_dir(dir_fd, rel)
    except OSError:
        return None


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


def _opaque(fd: int) -> bool:
    """overlayfs marks a directory the agent emptied and re-made: nothing below it."""
    try:
        return os.getxattr(fd, OPAQUE) == b"y"
    except OSError:
        return False


def _whiteout(dst: int, name: str) -> None:
    """What overlayfs reads as "deleted here" (a 0:0 character device)."""
    os.mknod(name, stat.S_IFCHR | 0o600, 0, dir_fd=dst)


@dataclass
class _Walk:
    """One graded path's copy: the agent's upper below it, checked against its view."""

    graded: str
    view_fd: int  # the graded path in the agent's merged view (where links resolve)
    whiteouts: bool  # the copy is layered over pristine content: keep deletions
    snap: Snapshot
    limits: _Limits


def _copy_entry(w: _Walk, src: int, dst: int, name: str, child: str, depth: int) -> bool:
    """Copy one entry of the upper; True if it is a directory to descend into."""
    inside = f"{w.graded}/{child}"
    try:
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        if depth + 1 > w.limits.depth:
            raise SnapshotTooLarge(f"{w.graded} is nested deeper than {w.limits.depth} directories")
        os.mkdir(name, 0o700, dir_fd=dst)
        return True
    if stat.S_ISREG(mode):
        if w.snap.bytes + st.st_size > w.limits.bytes:
            raise SnapshotTooLarge(f"more than {w.limits.bytes} bytes under {w.graded}")
        w.snap.bytes += _copy_file(src, dst, name, st)
        return False
    if stat.S_ISCHR(mode) and st.st_rdev == 0:  # the agent deleted a pristine entry
        if w.whiteouts:
            _whiteout(dst, name)
        return False
    if stat.S_ISLNK(mode):
        target = os.readlink(name, dir_fd=src)
        why = _link_stays_inside(w.view_fd, child, target, w.graded)
        if why is None:
            os.symlink(target, name, dir_fd=dst)
            return False
    else:
        why = f"not a file, directory or link ({_kind(mode)})"
    w.snap.refuse(inside, why)
    if w.whiteouts:  # and nothing pristine of that name shows through either
        _whiteout(dst, name)
    return False


def _copy_tree(w: _Walk, root_fd: int, dst_root: int) -> None:
    """Copy the agent's upper below ``root_fd`` into ``dst_root``, iteratively."""
    pending: list[tuple[str, int]] = [("", 0)]  # (path relative to the root, depth)
    finished: list[tuple[str, os.stat_result]] = []  # modes set last: dirs may be 0555
    while pending:
        rel, depth = pending.pop()
        src = _safe_dir(root_fd, rel)
        try:
            dst = _safe_dir(dst_root, rel)
            try:
                if rel and w.whiteouts and _opaque(src):
                    os.setxattr(dst, OPAQUE, b"y")
                with os.scandir(src) as it:
                    entries = [e.name for e in it]
                for name in entries:
                    w.snap.files += 1
                    if w.snap.files > w.limits.files:
                        raise SnapshotTooLarge(
                            f"more than {w.limits.files} entries under {w.graded}"
                        )
                    child = f"{rel}/{name}" if rel else name
                    if _copy_entry(w, src, dst, name, child, depth):
                        pending.append((child, depth + 1))
                        finished.append((child, os.stat(name, dir_fd=src, follow_symlinks=False)))
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


def _upper_hides_pristine(upper_fd: int, rel: str) -> bool:
    """Whether the agent's upper hides the pristine content at ``rel``: an opaque
    directory at it or above it (the agent removed and re-made it), or anything but a
    directory on the way."""
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        fd = _try_dir(upper_fd, "/".join(parts[:i]))
        if fd is None:
            try:
                os.stat("/".join(parts[:i]), dir_fd=upper_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False  # untouched from here down: the pristine content shows
            except OSError:
                pass
            return True
        try:
            if _opaque(fd):
                return True
        finally:
            os.close(fd)
    return False


def snapshot(
    view: Path,
    upper: Path,
    pristine: Path | None,
    graded: list[str],
    dest: Path,
    *,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Snapshot:
    """Copy what the agent changed under each graded path into ``dest/<i>``.

    ``view`` is the agent's merged, frozen view (it decides what exists and where links
    lead), ``upper`` its writable layer (what is copied), ``pristine`` the image alone
    (None: an empty image). Paths that do not exist are skipped (not in ``copies``); a
    graded path that is itself a link, or has a link among its parents, is refused.
    Raises SnapshotTooLarge past a bound (``dest`` is then left for the caller)."""
    limits = _Limits(max_files, max_bytes, max_depth)
    snap = Snapshot()
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    view_fd, upper_fd, dest_fd = fds = [
        os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in (view, upper, dest)
    ]
    pristine_fd = os.open(pristine, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if pristine else None
    try:
        for i, path in enumerate(graded):
            over = _snapshot_one(
                view_fd, upper_fd, dest_fd, pristine_fd, path, str(i), snap, limits
            )
            if over is not None:
                snap.copies[path] = GradedCopy(dest / str(i), over)
    finally:
        for fd in fds:
            os.close(fd)
        if pristine_fd is not None:
            os.close(pristine_fd)
    return snap


def _snapshot_one(
    view_fd: int,
    upper_fd: int,
    dest_fd: int,
    pristine_fd: int | None,
    path: str,
    slot: str,
    snap: Snapshot,
    limits: _Limits,
) -> bool | None:
    """Copy one graded path to ``dest/slot``: None if it is absent or refused, else
    whether the copy goes over the pristine content."""
    rel = path.lstrip("/")
    parent, _, name = rel.rpartition("/")
    try:
        parent_fd = _safe_dir(view_fd, parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # RESOLVE_NO_SYMLINKS met a link
            snap.refuse(path, "a parent directory of the graded path is a link")
        elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            snap.refuse(path, f"cannot open its parent ({os.strerror(exc.errno or 0)})")
        return None
    try:
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            snap.refuse(path, "the graded path itself is a link")
            return None
        if stat.S_ISREG(st.st_mode):
            if st.st_size > limits.bytes:
                raise SnapshotTooLarge(f"{path} is larger than {limits.bytes} bytes")
            snap.bytes += _copy_file(parent_fd, dest_fd, name, st, dst_name=slot)
            snap.files += 1
            return False
        if not stat.S_ISDIR(st.st_mode):
            snap.refuse(path, f"the graded path is a {_kind(st.st_mode)}")
            return None
        pristine_dir = None if pristine_fd is None else _try_dir(pristine_fd, rel)
        over = pristine_dir is not None and not _upper_hides_pristine(upper_fd, rel)
        if pristine_dir is not None:
            os.close(pristine_dir)
        os.mkdir(slot, 0o700, dir_fd=dest_fd)
        view_root = _safe_dir(parent_fd, name)
        dst_root = _safe_dir(dest_fd, slot)
        upper_root = _try_dir(upper_fd, rel)
        try:
            if upper_root is not None:
                _copy_tree(_Walk(path, view_root, over, snap, limits), upper_root, dst_root)
            _finish_dir(dst_root, st)
        finally:
            os.close(view_root)
            os.close(dst_root)
            if upper_root is not None:
                os.close(upper_root)
        return over
    finally:
        os.close(parent_fd)
