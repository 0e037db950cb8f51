"""The swap a job pause pushes anonymous memory into (DSEC.md §6.3), so that a pause
gives back what it claims by default, not only where an operator set swap up by hand.

Two kinds, both a file behind a loop device of the platform's own:

* **platform-managed** (the default, ``DSEC_SWAP=auto``): ``<data dir>/swap/pause.swap``
  of ``DSEC_SWAP_GB`` (8 by default, at most an eighth of the free disk), created at
  start (fallocate + mkswap, 0600; no zero fill, so a start stays fast), turned on, and
  turned off and deleted at a clean shutdown. A crash leaves it on: the next start on
  the same data dir adopts it (it is ours by its path). ``DSEC_SWAP=off``: no swap.
* **operator-configured**: ``DSEC_SWAP_FILE=/path`` (kept across restarts; zero-filled
  once at creation, see below): created if missing, turned on if it is not active yet,
  turned off at a clean shutdown only if *this* process turned it on.

Swap the operator configured by other means (fstab, zram, an already active file) is
never touched.

Why a file and not zram (measured here, 256 MiB of anonymous memory in one v1 cgroup,
``force_empty`` at swappiness 100, lz4): zram keeps the pages in RAM, compressed, so
what a pause frees depends on the data. Incompressible data (random bytes: model
outputs, compressed archives, images) went from 259 MiB in the cgroup to 258 MiB held
by zram: nothing freed. JSON-like text went to 8 MiB (97% freed). The file frees 100%
of either, in the same time (0.4-1.4 s for 256 MiB of 4 KiB pages on this noisy host,
both ways), and spends no host CPU on compression. zram stays the operator's choice
(an active zram area is used, never touched).

Why fallocate is enough: ext4 and XFS activate swap files through iomap, which accepts
unwritten (fallocated) extents and refuses only holes, inline data and shared (reflinked)
extents; btrfs refuses copy-on-write files, so the file may not live on btrfs (measured
on this host: a fallocated 8 GiB file on ext4 swapon's in one call, 125 extents). In
loop mode the file is then written with zeros once, at creation (direct I/O, ~3 s for
8 GiB here): the loop device writes through the file system, and a write into a
fallocated but never written extent costs an extent conversion; measured, a swap-out
into a fresh fallocated file ran at 2.1-2.2 GB/s, into a written one at 3.3-3.6 GB/s.

Why libc swapon(2)/swapoff(2) through ctypes rather than util-linux's commands: the
errno is exact (EBUSY = already active, EINVAL = a file system that cannot hold swap),
there is no output to parse, and nothing depends on the installed util-linux version.
Only the header is written by util-linux's ``mkswap`` (the format is its business).

Why a loop device over the file (the default; ``DSEC_SWAP_LOOP=0``: the file itself).
Measured here (kernel 6.18, 64 MiB of random data in a tmpfs file per cgroup, v1
``force_empty``): swapping out costs ~3.5-4.5 us of kernel CPU per 4 KiB page, so a
pause is CPU-bound on 2 cores (65-80 ms per cgroup one at a time, 44-55 ms two at a
time). Two things cut that:

* large folios: a tmpfs mounted ``huge=within_size`` (the sandboxes' /dev/shm) holds
  data written in big chunks in folios of up to 2 MiB, and the kernel swaps such a folio
  out in one piece (one slot allocation, one bio) -- but only to a swap *block device*
  (``cluster_alloc_swap_entry``: "Swapfile is not block device so unable to allocate
  large entries"); a file splits every folio first. 0.6 us per page instead of ~4;
  64 MiB in 25-31 ms, then bound by the disk (2.0-2.6 GB/s here);
* SSD mode: the kernel decides at swapon, from the device's ``queue/rotational``, how it
  hands out slots: on a "rotational" area every allocation takes one per-device lock, on
  an SSD area each CPU has its own cluster. A virtio disk says rotational=1 whatever
  backs it; the loop device is ours, so it is set to 0 (no host-wide setting changes).

End to end (bench/bench_rl.py, 100 sandboxes x 64 MiB of random data, one run): pause
16.4 ms per sandbox through the loop device, 56.3 ms with the file itself. Memory in
4 KiB pages (the same data written 4 KiB at a time; heaps without THP) still costs
~4 us a page: 45.6 ms per sandbox, CPU-bound, SSD mode being what keeps it under 50.

The loop device uses direct I/O (swap pages are not cached a second time in the file's
page cache; refused if the kernel cannot), 4 KiB blocks, and autoclear: it disappears by
itself at swapoff, also a swapoff by the operator. Where it cannot be set up (no loop
support), the file is turned on directly, as before.

Running sandboxes are kept off swap (v1 ``memory.swappiness=0`` on the edge's parent
cgroup, inherited by every sandbox created below it): a sandbox at its memory limit is
still OOM-killed as without swap, rather than filling the host's swap file; only a pause
raises a frozen sandbox's swappiness for the time of its reclaim (dsec.rl.jobs).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec import linux
from dsec.config import PLATFORM_SWAP
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


# linux/loop.h
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
# struct loop_config {u32 fd, block_size; struct loop_info64 info; u64 reserved[8]}
LOOP_CONFIG = struct.Struct("=II5Q4I64s64s32s2Q8Q")
LOOP_BLOCK_SIZE = 4096


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
                    linux.unescape_mount_field(fields[0]),
                    fields[1],
                    int(fields[2]) * 1024,
                    int(fields[3]) * 1024,
                )
            )
    return out


def loop_backing_file(dev: str) -> str | None:
    """The file behind a loop device (None: not a bound loop device)."""
    name = os.path.basename(dev)
    if not name.startswith("loop"):
        return None
    try:
        text = Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    except OSError:
        return None
    return text.removesuffix(" (deleted)")


def area_file(entry: SwapEntry) -> str:
    """Where an active swap area keeps its pages: its own name, or a loop device's file."""
    return loop_backing_file(entry.filename) or entry.filename


def is_platform_swap(entry: SwapEntry) -> bool:
    """Whether an active area is some platform's own pause swap (``<data dir>/swap/
    pause.swap``, behind a loop device or not): every ``dsec up`` on the host turns one
    on and off, so a view of the operator's swap leaves these out."""
    return area_file(entry).endswith("/" + "/".join(PLATFORM_SWAP))


def operator_swaps() -> list[SwapEntry]:
    """The active swap areas that no platform manages (the host's own)."""
    return [s for s in active_swaps() if not is_platform_swap(s)]


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


def _attach_loop(path: Path) -> tuple[int, str]:
    """Bind ``path`` to a free loop device (direct I/O, 4 KiB blocks, autoclear, not
    rotational); (open fd of the device, its path). Autoclear detaches the device at its
    last close: the caller keeps the fd open until swapon holds the device."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        backing = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        os.close(ctl)
        raise
    try:
        for _ in range(8):
            dev = f"/dev/loop{fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)}"
            fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            cfg = LOOP_CONFIG.pack(
                backing,
                LOOP_BLOCK_SIZE,
                *(0,) * 5,
                0,
                0,
                0,
                LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                os.fsencode(path)[:63],
                b"",
                b"",
                *(0,) * 10,
            )
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, cfg)
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.EBUSY:  # taken by someone else meanwhile
                    continue
                raise
            try:
                sysfs = Path("/sys/block") / os.path.basename(dev)
                if (sysfs / "loop" / "dio").read_text().strip() != "1":
                    raise OSError(errno.EINVAL, f"{dev}: no direct I/O on {path}")
                (sysfs / "queue" / "rotational").write_text("0")
            except OSError:
                os.close(fd)  # autoclear: detached
                raise
            return fd, dev
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(backing)
        os.close(ctl)


def _write_zeros(path: Path, size: int) -> None:
    """Write every block of ``path`` once (see the module doc), bypassing the page cache
    (8 GiB of dirty pages would push the host into reclaim)."""
    chunk = 8 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned zeros, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        buf.close()
        if exc.errno == errno.EINVAL:  # no direct I/O here: stay fallocated
            return
        raise
    try:
        done, size = 0, size - size % mmap.PAGESIZE  # a partial page stays fallocated
        while done < size:
            n = min(chunk, size - done)
            done += os.pwrite(fd, memoryview(buf)[:n], done)
    finally:
        os.close(fd)
        buf.close()


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
    """The platform's own swap file; ``activated``: this process turned it on; ``loop``:
    through a loop device (see the module doc), ``device``: the one it is on."""

    path: Path
    size_bytes: int
    created: bool = False
    activated: bool = False
    loop: bool = False
    device: str | None = None
    # Platform-managed (module doc): adopted when a crash left it on; removed at a
    # clean shutdown; not zero-filled at creation (a fast start over peak throughput).
    managed: bool = False

    def _active(self) -> bool:
        real = os.path.realpath(self.path)
        return any(os.path.realpath(area_file(s)) == real for s in active_swaps())

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
            if self.loop and not self.managed:
                _write_zeros(self.path, self.size_bytes)
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
            if self.managed:  # ours, left on by a crash: turned off at our shutdown
                self._adopt()
                return
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
        if self.loop and self._swapon_loop():
            return
        try:
            _swapon(self.path)
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # turned on by someone else meanwhile
                return
            raise SwapError(str(exc)) from exc
        self.activated = True
        log.info("swap file %s on (%d GiB)", self.path, self.size_bytes // GiB)

    def _adopt(self) -> None:
        real = os.path.realpath(self.path)
        for s in active_swaps():
            if os.path.realpath(area_file(s)) == real:
                self.activated = True
                self.device = s.filename if loop_backing_file(s.filename) else None
                self.created = True  # ours by its path: deleted at the shutdown
                log.info("swap file %s was left on (a crash): adopted", self.path)
                return

    def _swapon_loop(self) -> bool:
        """Turn the file on through a loop device; False: no loop device (use the file)."""
        try:
            fd, dev = _attach_loop(self.path)
        except OSError as exc:
            log.warning("swap file %s: no loop device (%s); turned on as a file", self.path, exc)
            return False
        try:
            _swapon(Path(dev))
        except OSError as exc:
            log.warning("swap file %s: swapon %s failed (%s); trying the file", self.path, dev, exc)
            return False
        finally:
            os.close(fd)  # swap holds the device now (or, on error, autoclear frees it)
        self.activated, self.device = True, dev
        log.info("swap file %s on through %s (%d GiB)", self.path, dev, self.size_bytes // GiB)
        return True

    def disable(self) -> None:
        """Turn off what ``enable`` turned on (blocks while used pages come back)."""
        if not self.activated:
            return
        backing = loop_backing_file(self.device) if self.device else None
        if self.device and (backing is None or Path(backing) != self.path.resolve()):
            # Turned off by someone else and the loop device freed (autoclear): the
            # number may now serve another swap area, which is not ours to turn off.
            self.activated, self.device = False, None
            return
        try:
            _swapoff(Path(self.device) if self.device else self.path)  # autoclear: loop gone
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: no longer active
                log.error("cannot turn swap file %s off: %s", self.path, exc)
                return
        self.activated, self.device = False, None
        log.info("swap file %s off", self.path)

    def remove(self) -> None:
        """Turn off (if ours) and delete the file, if this object created it."""
        self.disable()
        if self.created and not self.activated:
            self.path.unlink(missing_ok=True)
            self.created = False


def managed_size(directory: Path, wanted: int) -> int:
    """The platform-managed file's size: ``wanted``, at most an eighth of the free space
    of the file system it goes on (whole MiB)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return min(wanted, st.f_bavail * st.f_frsize // 8) // (1 << 20) * (1 << 20)


def remove_areas_below(directory: Path) -> list[str]:
    """Turn off every swap area whose file lies below ``directory`` (test and crash
    cleanup of a platform-managed file); the names turned off."""
    base = os.path.realpath(directory).rstrip("/") + "/"
    done: list[str] = []
    for s in active_swaps():
        if os.path.realpath(area_file(s)).startswith(base):
            with contextlib.suppress(OSError):
                _swapoff(Path(s.filename))
                done.append(s.filename)
    return done


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
