"""Thin wrappers over Linux syscalls that Python 3.11's stdlib lacks.

A mount through the syscall costs ~0.4 ms; through the `mount` command ~2 ms
(HOST_LIMITS.md), and sandbox creation does several, so we call libc directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the platform reads about a process."""

    comm: str
    state: str  # R, S, D, T (stopped), t (traced), Z (zombie), X (dead), ...
    ppid: int
    start_time: int  # clock ticks after boot (field 22): tells a reused pid apart

    @property
    def dead(self) -> bool:
        """Exited: a zombie not reaped by its parent yet, or being removed."""
        return self.state in ("Z", "X")

    @property
    def stopped(self) -> bool:
        """Held by SIGSTOP (a stopped QEMU) or by a tracer."""
        return self.state in ("T", "t")


def proc_stat(pid: int) -> ProcStat | None:
    """/proc/PID/stat of ``pid``; None once it is gone (reaped) or cannot be read.
    The name may hold any byte, ')' and spaces too: the fields follow the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    name, _, rest = raw.rpartition(b")")
    fields = rest.split()
    if len(fields) < 20:
        return None
    comm = name.partition(b"(")[2].decode(errors="replace")
    return ProcStat(comm, fields[0].decode(), int(fields[1]), int(fields[19]))


def proc_stats() -> Iterator[tuple[int, ProcStat]]:
    """(pid, stat) of every process on the host that is there while we look."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
            yield int(entry), st


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (signal 0: nothing is sent). A process we may
    not signal runs too; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OSError as exc:  # pragma: no cover - unexpected errno
        return exc.errno != errno.ESRCH
    st = proc_stat(pid)
    return st is None or not st.dead  # no /proc view of it: kill() said it exists


PR_SET_CHILD_SUBREAPER = 36
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def become_subreaper() -> None:
    """Make this process the reaper of its descendants' orphans: a process whose parent
    dies is re-parented to us, not to the machine's pid 1 (which on some hosts never
    reaps), so that we can reap it."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def _raise(what: str, path: str | os.PathLike[str]) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what} {path}: {os.strerror(err)}")


def mount(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    fstype: str,
    flags: int = 0,
    data: str | None = None,
) -> None:
    rc = _libc.mount(
        os.fsencode(source),
        os.fsencode(target),
        fstype.encode(),
        flags,
        data.encode() if data is not None else None,
    )
    if rc != 0:
        _raise(f"mount -t {fstype} {source} on", target)


_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2) mode 0: give ``fd`` real blocks for the range. Unlike
    ``os.posix_fallocate`` it never falls back to writing zeros (which takes minutes
    for GiBs): a file system without support raises EOPNOTSUPP instead."""
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def umount(target: str | os.PathLike[str], *, detach: bool = False) -> None:
    """Unmount; an already unmounted target is not an error."""
    rc = _libc.umount2(os.fsencode(target), MNT_DETACH if detach else 0)
    if rc != 0:
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOENT):
            return
        _raise("umount", target)


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str


def unescape_mount_field(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts(under: str | os.PathLike[str] | None = None) -> list[MountEntry]:
    """Mounts of this mount namespace, optionally only those at or below ``under``."""
    prefix = str(Path(under).resolve()) if under is not None else None
    entries: list[MountEntry] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rfields = right.split()
            point = unescape_mount_field(fields[4])
            if prefix is not None and not (point == prefix or point.startswith(prefix + "/")):
                continue
            entries.append(MountEntry(point, rfields[0], unescape_mount_field(rfields[1])))
    return entries


def is_mounted(path: str | os.PathLike[str]) -> bool:
    target = str(Path(path).resolve())
    return any(m.mount_point == target for m in mounts(target))


@contextlib.contextmanager
def socket_path_nofollow(path: Path | str) -> Iterator[str]:
    """A path to ``connect()`` to the unix socket at ``path`` that never follows a link
    in its last component: yields ``/proc/self/fd/N`` of an ``O_PATH|O_NOFOLLOW`` fd
    checked to be a socket (valid while the block runs).

    Why: the edge (root, the host's mount namespace) connects to sockets that a jailed
    VMM creates in a directory it can write (QMP, the guest agent, the agent channel,
    VNC). A VMM taken over by its guest could put a symlink there, and a plain
    ``connect(path)`` would follow it to any socket of the host (another sandbox's
    agent, a daemon's control socket) and relay our bytes, or a viewer's, to it.
    Raises OSError: ENOTSOCK for a link (``O_PATH|O_NOFOLLOW`` opens the link itself)
    or anything else that is not a socket, ENOENT while it does not exist yet."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, "not a socket", str(path))
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
