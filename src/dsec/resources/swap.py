"""An operator-configured swap file, so that a job pause can push anonymous memory out
of RAM (DSEC.md §6.3: "swap where configured").

Off by default. With ``DSEC_SWAP_FILE=/path`` and ``DSEC_SWAP_GB=n`` the platform, at
start, creates the file if it is missing (fallocate + mkswap, mode 0600), turns it on if
it is not active yet, remembers whether *it* did, and turns off at a clean shutdown
(after the sandboxes are stopped) only what it turned on. Swap the operator configured
by other means (fstab, zram, an already active file) is never touched.

Why fallocate is enough: ext4 and XFS activate swap files through iomap, which accepts
unwritten (fallocated) extents and refuses only holes, inline data and shared (reflinked)
extents; btrfs refuses copy-on-write files, so the file may not live on btrfs (measured
on this host: a fallocated 8 GiB file on ext4 swapon's in one call, 125 extents).

Why libc swapon(2)/swapoff(2) through ctypes rather than util-linux's commands: the
errno is exact (EBUSY = already active, EINVAL = a file system that cannot hold swap),
there is no output to parse, and nothing depends on the installed util-linux version.
Only the header is written by util-linux's ``mkswap`` (the format is its business).

Running sandboxes are kept off swap (v1 ``memory.swappiness=0`` on the edge's parent
cgroup, inherited by every sandbox created below it): a sandbox at its memory limit is
still OOM-killed as without swap, rather than filling the host's swap file; only a pause
raises a frozen sandbox's swappiness for the time of its reclaim (dsec.rl.jobs).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec import linux
from dsec.resources.cgroups import CgroupHost

log = logging.getLogger(__name__)

GiB = 1 << 30
SWAP_SIGNATURES = (b"SWAPSPACE2", b"SWAP-SPACE")
# File systems whose swap_activate accepts a fallocated file (see the module doc).
SWAP_FILE_SYSTEMS = frozenset({"ext4", "ext3", "ext2", "xfs"})


class SwapError(RuntimeError):
    """The configured swap file cannot be used (the platform starts without it)."""


@dataclass(frozen=True)
class SwapEntry:
    filename: str
    kind: str
    size_bytes: int
    used_bytes: int


def active_swaps() -> list[SwapEntry]:
    """/proc/swaps, parsed (sizes there are KiB; names escape blanks as octal)."""
    out: list[SwapEntry] = []
    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        with contextlib.suppress(ValueError):
            out.append(
                SwapEntry(
                    linux._unescape(fields[0]),
                    fields[1],
                    int(fields[2]) * 1024,
                    int(fields[3]) * 1024,
                )
            )
    return out


def swap_free_bytes() -> int:
    """Free swap over every active area: what a pause can push anonymous memory into."""
    return sum(max(0, s.size_bytes - s.used_bytes) for s in active_swaps())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _swapon(path: Path) -> None:
    if _libc().swapon(os.fsencode(path), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"swapon {path}: {os.strerror(err)}")


def _swapoff(path: Path) -> None:
    if _libc().swapoff(os.fsencode(path)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"swapoff {path}: {os.strerror(err)}")


def _fs_type(path: Path) -> str:
    target = os.path.realpath(path)
    best, fstype = "", ""
    for m in linux.mounts():
        point = m.mount_point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, m.fstype
    return fstype


def _has_signature(path: Path) -> bool:
    page = os.sysconf("SC_PAGE_SIZE")
    with open(path, "rb") as fh:
        fh.seek(page - 10)
        return fh.read(10) in SWAP_SIGNATURES


@dataclass
class SwapFile:
    """The platform's own swap file; ``activated``: this process turned it on."""

    path: Path
    size_bytes: int
    created: bool = False
    activated: bool = False

    def _active(self) -> bool:
        real = os.path.realpath(self.path)
        return any(os.path.realpath(s.filename) == real for s in active_swaps())

    def check_location(self, forbidden: list[Path]) -> None:
        """Refuse a place a sandbox could see or that cannot hold swap."""
        if not self.path.is_absolute():
            raise SwapError(f"swap file {self.path} must be an absolute path")
        real = Path(os.path.realpath(self.path))
        for bad in forbidden:
            bad_real = Path(os.path.realpath(bad))
            if real == bad_real or bad_real in real.parents:
                raise SwapError(f"swap file {self.path} is inside {bad} (sandbox-visible)")
        fstype = _fs_type(real.parent)
        if fstype not in SWAP_FILE_SYSTEMS:
            raise SwapError(
                f"swap file {self.path} is on {fstype or 'an unknown file system'}; "
                f"a fallocated swap file needs one of {sorted(SWAP_FILE_SYSTEMS)}"
            )

    def _create(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size_bytes)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        res = subprocess.run(
            ["mkswap", str(self.path)], capture_output=True, text=True, check=False
        )
        if res.returncode != 0:
            self.path.unlink(missing_ok=True)
            raise SwapError(f"mkswap {self.path}: {res.stderr.strip()}")
        self.created = True
        log.info("created swap file %s (%d GiB)", self.path, self.size_bytes // GiB)

    def enable(self) -> None:
        """Create (if missing) and turn on; a no-op if it is already active."""
        if self._active():
            log.info("swap file %s is already active: left as it is", self.path)
            return
        if not self.path.exists():
            self._create()
        st = os.lstat(self.path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            raise SwapError(f"{self.path} is not a regular file owned by root")
        if st.st_mode & 0o077:
            os.chmod(self.path, 0o600)  # the kernel warns about (and we refuse) readers
        if not _has_signature(self.path):
            # Never mkswap a file we did not create: it may hold someone's data.
            raise SwapError(f"{self.path} exists but is not a swap file (no mkswap header)")
        try:
            _swapon(self.path)
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # turned on by someone else meanwhile
                return
            raise SwapError(str(exc)) from exc
        self.activated = True
        log.info("swap file %s on (%d GiB)", self.path, self.size_bytes // GiB)

    def disable(self) -> None:
        """Turn off what ``enable`` turned on (blocks while used pages come back)."""
        if not self.activated:
            return
        try:
            _swapoff(self.path)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: no longer active
                log.error("cannot turn swap file %s off: %s", self.path, exc)
                return
        self.activated = False
        log.info("swap file %s off", self.path)

    def remove(self) -> None:
        """Turn off (if ours) and delete the file, if this object created it."""
        self.disable()
        if self.created and not self.activated:
            self.path.unlink(missing_ok=True)
            self.created = False


def keep_sandboxes_off_swap(host: CgroupHost, parent_rel: str) -> bool:
    """v1: ``memory.swappiness=0`` on the sandboxes' parent cgroup, inherited by each
    sandbox at creation, so that running sandboxes never swap (see the module doc).
    v2 has no per-cgroup swappiness; there, sandboxes may swap at their limit."""
    mem = host.v1.get("memory")
    if mem is None:
        return False
    d = mem / parent_rel.strip("/")
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.swappiness").write_text("0")
    except OSError as exc:
        log.warning("cannot keep sandboxes off swap (%s): %s", d, exc)
        return False
    return True
