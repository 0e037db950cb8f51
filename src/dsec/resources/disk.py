"""Per-sandbox writable disk limits, enforced by the kernel.

Every sandbox's overlay upper and work directories live in ``<data_dir>/sandboxes/<id>``.
On the host's root file system nothing bounds them: one sandbox could fill the host's
disk. The field's standard (Docker overlay2 ``--storage-opt size``) is an XFS project
quota, but this fleet's kernels are built without ``CONFIG_XFS_QUOTA`` and without
``CONFIG_QFMT_V2`` (so no ext4 project quota either; both mounts fail with "quota
support not available"). What the kernel does have is btrfs with quota groups, so:

* ``<data_dir>/sandboxes`` is a btrfs file system in a sparse image file
  (``<data_dir>/sandboxes.img``), formatted once, loop-mounted at start (autoclear loop
  device), unmounted at a clean shutdown and re-used across restarts, so re-adopted
  sandboxes keep their data. If the directory is already a btrfs mount it is used as is.
* Each sandbox directory is a btrfs *subvolume* with a *simple quota* group limit
  (``BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA``, Linux 6.7+: no backref walks, cheap deletes).
  Writes past the limit fail with EDQUOT inside the sandbox; the host only ever sees the
  image file, which cannot grow past its size.
* btrfs allocates inodes dynamically (there is no inode table to exhaust) and charges
  metadata to the quota group too, so the byte limit also bounds the number of files
  (measured: a 20 MiB group stops at ~58,000 empty files). That is why there is no
  separate inode limit: it could not be enforced by the kernel here, and there is no
  shared inode pool for a sandbox to exhaust.

* A sparse image on a data dir that fills up is the danger: measured, a 50 MiB write
  inside reported success, the loop device's writeback then failed, btrfs aborted its
  transaction and went read-only, and every sandbox of the edge got EIO. By default a
  *host-space guard* (dsec.resources.diskguard, run by the edge's supervisor every
  0.5 s) prevents it: while the host's free space cannot back the image's possible
  growth (plus a reserve), it clamps each live sandbox's quota limit to its usage plus
  a fair share of what is left, so writes past it fail with EDQUOT inside at
  ``write()`` time, and it restores the configured limits once space is back. What it
  cannot catch: more than the reserve (at least 512 MiB) written between two of its
  ticks while the host fills up, or space taken by others faster than that.
* With ``DSEC_SANDBOX_DISK_PREALLOCATE=1`` the image is *preallocated* (``fallocate``,
  ~10 ms for GiBs on ext4: unwritten extents) and mounted ``nodiscard``, so it never has
  to grow and no guard is needed: a write past the image's capacity fails with ENOSPC
  inside, the host disk untouched. Not the default: the first write to each
  preallocated block converts an unwritten extent at btrfs's commit-time flush, and
  create/stop measured +14%/+5% (bench/bench_ab.py). Without ``nodiscard`` the loop
  device would punch freed blocks out of the file again (btrfs turns discard on by
  default). A host that cannot preallocate (no space, no fallocate support) keeps the
  sparse image, guarded, and says so in the log.

* A preallocated image smaller than 5 GiB gets *mixed* block groups (``MIXED_BELOW``):
  with separate data and metadata ones, a sandbox that filled a small image left it
  unable to create a file for good, even after deleting everything. (A sparse image is
  guarded, so no sandbox fills it; it keeps separate groups, as before.)

Create pays two ioctls (subvolume create, qgroup limit) and teardown one (subvolume
destroy, which also drops everything in it without walking the tree), plus the guard's
dict update.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from dsec import linux
from dsec.resources.diskguard import HostSpaceGuard

log = logging.getLogger(__name__)

BTRFS_SUPER_MAGIC = 0x9123683E
BTRFS_FIRST_FREE_OBJECTID = 256
_VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args: __s64 fd; char name[4088]
_NAME_MAX = 4087
BTRFS_QUOTA_CTL_ENABLE = 1
BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4  # Linux 6.7
BTRFS_QGROUP_LIMIT_MAX_RFER = 1 << 0
BTRFS_QGROUP_LIMIT_MAX_EXCL = 1 << 1


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_IOW, _IOR, _IOWR = 1, 2, 3
BTRFS_IOC_SYNC = _ioc(0, 8, 0)
BTRFS_IOC_SUBVOL_CREATE = _ioc(_IOW, 14, _VOL_ARGS)
BTRFS_IOC_SNAP_DESTROY = _ioc(_IOW, 15, _VOL_ARGS)
BTRFS_IOC_INO_LOOKUP = _ioc(_IOWR, 18, 4096)  # treeid, objectid, name[4080]
BTRFS_IOC_FS_INFO = _ioc(_IOR, 31, 1024)
BTRFS_IOC_QUOTA_CTL = _ioc(_IOWR, 40, 16)  # cmd, status
BTRFS_IOC_QGROUP_LIMIT = _ioc(_IOR, 43, 48)  # qgroupid, btrfs_qgroup_limit (5 x u64)

MiB = 1024 * 1024
GiB = 1024 * MiB
DEFAULT_IMAGE_CAP = 512 * GiB
# The default size of a preallocated image (half the free space, at most this): the
# host pays for all of it up front. Set DSEC_SANDBOX_DISK_GB for more.
DEFAULT_PREALLOCATED_CAP = 8 * GiB
DEFAULT_LIMIT = 10 * GiB  # per sandbox, when its spec names none (Docker-like)
# Below this size the image gets mixed block groups (data and metadata share them).
# With separate ones a small file system holds one data chunk of nearly its whole size,
# which btrfs never deletes when it empties (it is the last of its type): once data has
# taken all unallocated space, creating a file needs a metadata chunk that can never be
# allocated, and every sandbox got ENOSPC for good even after the files were removed
# (measured on a 1 GiB image: 30 s after `rm` and `sync`, still ENOSPC; mixed: at once).
# btrfs's own advice (mkfs.btrfs(8) --mixed) is the same bound, "smaller than 5GiB".
MIXED_BELOW = 5 * GiB


@dataclass(frozen=True)
class DiskUsage:
    """Bytes charged to a sandbox's quota group and its limit (0 = none)."""

    used: int
    limit: int

    @property
    def at_limit(self) -> bool:
        """Within 1% (at least 1 MiB) of the limit: the next write may fail. The kernel
        refuses a write that would cross the limit, so usage stops a little below it."""
        return self.limit > 0 and self.used + max(MiB, self.limit // 100) >= self.limit


def _vol_args(name: str) -> bytearray:
    raw = os.fsencode(name)
    if not raw or b"/" in raw or len(raw) > _NAME_MAX:
        raise ValueError(f"invalid subvolume name {name!r}")
    buf = bytearray(_VOL_ARGS)
    buf[8 : 8 + len(raw)] = raw
    return buf


def subvolume_id(path: Path) -> int:
    """The btrfs tree id of the subvolume ``path`` is the root of (0 if not btrfs)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(4096)
        struct.pack_into("=QQ", buf, 0, 0, BTRFS_FIRST_FREE_OBJECTID)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_INO_LOOKUP, buf)
        except OSError as exc:
            if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                return 0
            raise
        return int(struct.unpack_from("=Q", buf, 0)[0])
    finally:
        os.close(fd)


def _is_btrfs(path: Path) -> bool:
    # os.statvfs lacks f_type; the mount table says it just as well for our one mount.
    target = os.path.realpath(path)
    best = ""
    fstype = ""
    for m in linux.mounts():
        point = m.mount_point
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(
            best
        ):
            best, fstype = point, m.fstype
    return fstype == "btrfs"


def _loop_backing_file(device: str) -> str | None:
    name = os.path.basename(device)
    try:
        return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    except OSError:
        return None


def loop_devices_backed_by(under: Path) -> list[str]:
    """Loop devices whose backing file lies below ``under`` (leak checks)."""
    prefix = str(under.resolve())
    found = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir("/sys/block")):
            if entry.startswith("loop"):
                backing = _loop_backing_file(entry)
                if backing and (backing == prefix or backing.startswith(prefix + "/")):
                    found.append(f"/dev/{entry}")
    return found


class SandboxDisk:
    """The file system that holds sandboxes' writable directories, one quota each.

    ``size_bytes`` sizes the image when it is first created (None: half the free space
    of the file system below, at most 512 GiB). ``enabled=False`` (or a host where the
    mount fails) keeps plain directories on the host file system, without limits, and
    says so in the log: a sandbox can then fill the host's disk.
    """

    def __init__(
        self,
        mount_point: Path,
        image: Path,
        *,
        size_bytes: int | None = None,
        enabled: bool = True,
        preallocate: bool = True,
    ) -> None:
        self.mount_point = mount_point
        self.preallocate = preallocate
        self.preallocated = False  # the whole image is allocated on the host
        self.image = image
        self.size_bytes = size_bytes
        self.want = enabled
        self.enabled = False
        self.mounted_by_us = False
        self.capacity = 0
        self._qgroups_sysfs: Path | None = None
        # Set by open() for a sparse image of ours (see the module docstring).
        self.guard: HostSpaceGuard | None = None

    # -- start and stop --------------------------------------------------------------------
    def open(self) -> None:
        """Mount (or adopt) the sandboxes file system and turn quotas on; idempotent."""
        self.mount_point.mkdir(parents=True, exist_ok=True)
        if not self.want:
            log.warning("sandbox disk limits are off: a sandbox can fill %s", self.mount_point)
            return
        try:
            if not linux.is_mounted(self.mount_point):
                if any(os.scandir(self.mount_point)):
                    # Sandboxes of an older version live here; mounting would hide them.
                    log.warning(
                        "%s is not empty and not a mount: disk limits stay off until it is",
                        self.mount_point,
                    )
                    return
                self._format_once()
                self._allocate()
                self._mount()
            elif self._is_our_image():
                # Still mounted after a crash: re-adopt it, and unmount it at the end.
                self.mounted_by_us = True
            if not _is_btrfs(self.mount_point):
                log.warning("%s is not btrfs: sandbox disk limits are off", self.mount_point)
                return
            self._enable_quotas()
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("sandbox disk limits are off: %s", exc)
            return
        st = os.statvfs(self.mount_point)
        self.capacity = st.f_blocks * st.f_frsize
        self.enabled = True
        if self.mounted_by_us and not self.preallocated and self.guard is None:
            self.guard = HostSpaceGuard(
                self.image, set_limit=self.relimit, read_used=self.used_bytes
            )
        log.info(
            "sandbox disk: btrfs at %s, %.1f GiB, per-sandbox quota groups",
            self.mount_point,
            self.capacity / GiB,
        )

    def _default_size(self) -> int:
        st = os.statvfs(self.image.parent)
        free = st.f_bavail * st.f_frsize
        cap = DEFAULT_PREALLOCATED_CAP if self.preallocate else DEFAULT_IMAGE_CAP
        return max(1 * GiB, min(cap, free // 2)) // MiB * MiB

    def _allocate(self) -> None:
        """Give the whole image its blocks on the host (idempotent: an image already
        allocated costs one extent walk), so that a full data dir cannot fail writes
        inside the sandboxes behind their back (see the module docstring)."""
        if not self.preallocate:
            return
        size = self.image.stat().st_size
        fd = os.open(self.image, os.O_RDWR | os.O_CLOEXEC)
        try:
            linux.fallocate(fd, 0, size)
        except OSError as exc:
            free = os.statvfs(self.image.parent)
            log.warning(
                "sandbox disk image %s stays sparse (%s; %.1f GiB free on the host): "
                "if the data dir fills up, writes inside sandboxes fail with EIO; free "
                "space, lower DSEC_SANDBOX_DISK_GB for a new image, or set "
                "DSEC_SANDBOX_DISK_PREALLOCATE=0 to accept that",
                self.image,
                exc.strerror or exc,
                free.f_bavail * free.f_frsize / GiB,
            )
            return
        finally:
            os.close(fd)
        self.preallocated = True

    def _format_once(self) -> None:
        if self.image.exists():
            return
        size = self.size_bytes or self._default_size()
        tmp = self.image.with_name(self.image.name + ".new")
        tmp.unlink(missing_ok=True)
        with open(tmp, "wb") as fh:
            fh.truncate(size)  # sparse: the host pays only for what sandboxes write
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            tmp.unlink()
            raise OSError("mkfs.btrfs not found (install btrfs-progs: scripts/install.sh)")
        if self.preallocate:  # before mkfs, so that it fails fast on a host without room
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            try:
                linux.fallocate(fd, 0, size)
            except OSError as exc:
                tmp.unlink()
                raise OSError(
                    exc.errno,
                    f"cannot preallocate the {size / GiB:.1f} GiB sandbox disk image {tmp}: "
                    f"{exc.strerror}; free space, set DSEC_SANDBOX_DISK_GB lower or "
                    "DSEC_SANDBOX_DISK_PREALLOCATE=0",
                ) from None
            finally:
                os.close(fd)
        # Only a preallocated image can fill up (a sparse one is guarded: its sandboxes'
        # limits are clamped below what the host can back, see diskguard).
        mixed = ["--mixed"] if self.preallocate and size < MIXED_BELOW else []
        profiles = ["-m", "single", "-d", "single"]
        res = subprocess.run(
            [mkfs, "-q", "-f", *mixed, *profiles, "-L", "dsec-sandboxes", str(tmp)],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            tmp.unlink()
            raise OSError(f"mkfs.btrfs {tmp}: {res.stderr.strip()}")
        os.replace(tmp, self.image)
        log.info(
            "formatted %s (%.1f GiB, %s%s)",
            self.image,
            size / GiB,
            "preallocated" if self.preallocate else "sparse",
            ", mixed block groups" if mixed else "",
        )

    def _mount(self) -> None:
        # util-linux allocates the loop device with LO_FLAGS_AUTOCLEAR: it goes away
        # with the last unmount, so a crash between the two never strands it.
        res = subprocess.run(
            [
                "mount",
                "-t",
                "btrfs",
                "-o",
                # nodiscard: a discard would punch the freed blocks out of a
                # preallocated image (btrfs discards by default on loop devices)
                "loop,noatime,nodiscard" if self.preallocate else "loop,noatime,discard=async",
                str(self.image),
                str(self.mount_point),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise OSError(f"mount {self.image} on {self.mount_point}: {res.stderr.strip()}")
        self.mounted_by_us = True

    def _is_our_image(self) -> bool:
        target = str(self.mount_point.resolve())
        for m in linux.mounts(target):
            if m.mount_point == target and m.source.startswith("/dev/loop"):
                backing = _loop_backing_file(m.source)
                return backing is not None and os.path.realpath(backing) == str(
                    self.image.resolve()
                )
        return False

    def _enable_quotas(self) -> None:
        fsid = self._fsid()
        sysfs = Path(f"/sys/fs/btrfs/{fsid}")
        self._qgroups_sysfs = sysfs / "qgroups"
        if (sysfs / "qgroups").is_dir():
            return
        fd = os.open(self.mount_point, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for cmd in (BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, BTRFS_QUOTA_CTL_ENABLE):
                try:
                    fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("=QQ", cmd, 0)))
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # older kernel: full qgroups instead
                        raise
        finally:
            os.close(fd)

    def _fsid(self) -> str:
        return fsid(self.mount_point)

    def close(self) -> None:
        """Unmount when no sandbox directory is left (live ones keep the mount)."""
        if not self.mounted_by_us or not linux.is_mounted(self.mount_point):
            return
        if any(os.scandir(self.mount_point)):
            log.info("sandboxes remain in %s: leaving it mounted", self.mount_point)
            return
        try:
            linux.umount(self.mount_point)
        except OSError as exc:
            log.warning("unmount %s: %s; detaching lazily", self.mount_point, exc)
            linux.umount(self.mount_point, detach=True)
        self.mounted_by_us = False
        self.enabled = False

    # -- per sandbox -----------------------------------------------------------------------
    def limit_bytes(self, limit_mb: int | None) -> int:
        """A spec's limit in bytes; None is the default (10 GiB, at most the disk)."""
        if limit_mb is not None:
            return limit_mb * MiB
        return min(DEFAULT_LIMIT, self.capacity) if self.capacity else DEFAULT_LIMIT

    def create_dir(self, path: Path, *, limit_bytes: int) -> int:
        """Create a sandbox's directory with its own quota; returns the quota group id
        (0 when limits are off: then it is a plain directory)."""
        if not self.enabled:
            path.mkdir(parents=True, exist_ok=False)
            return 0
        if self.guard is not None:
            self.guard.check_room()  # 507 while the host leaves no share for it
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, BTRFS_IOC_SUBVOL_CREATE, _vol_args(path.name))
        finally:
            os.close(parent)
        try:
            qgroup = subvolume_id(path)
            self.set_limit(path, qgroup, self.admit(path, qgroup, limit_bytes))
        except BaseException:
            self.remove_dir(path)
            raise
        return qgroup

    def admit(self, path: Path, qgroup: int, limit_bytes: int) -> int:
        """The limit to give sandbox directory ``path`` now (its configured one unless
        the guard is clamping), tracking it; for a re-adopted sandbox too."""
        return self.guard.admit(path, qgroup, limit_bytes) if self.guard else limit_bytes

    def adopt_dir(self, path: Path, qgroup: int, *, limit_bytes: int) -> None:
        """Take back a sandbox directory after a restart: the guard tracks it again, and
        its configured limit is re-applied (a crash may have left a clamped one)."""
        if not self.enabled or not qgroup:
            return
        try:
            self.relimit(path, qgroup, self.admit(path, qgroup, limit_bytes))
        except OSError as exc:  # the sandbox still runs; its old limit stays
            log.warning("re-applying the disk limit of %s: %s", path, exc)

    @staticmethod
    def set_limit(path: Path, qgroup: int, limit_bytes: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            flags = BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL
            args = struct.pack("=QQQQQQ", qgroup, flags, limit_bytes, limit_bytes, 0, 0)
            fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, bytearray(args))
        finally:
            os.close(fd)

    def relimit(self, path: Path, qgroup: int, limit_bytes: int) -> None:
        """Change the limit of a live sandbox's quota group ``qgroup`` (``path``: its
        directory, for the error). Issued on the top-level subvolume: the ioctl starts
        a transaction that reserves metadata against the subvolume it is called on, so
        one at its limit (EDQUOT) could never be loosened from inside."""
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, "no such sandbox directory", str(path))
        self.set_limit(self.mount_point, qgroup, limit_bytes)

    def remove_dir(self, path: Path) -> bool:
        """Destroy a sandbox's subvolume with everything in it. Returns False when
        ``path`` is not a subvolume (the caller removes a plain directory itself).
        The kernel drops the subvolume's quota group once its blocks are freed."""
        if not self.enabled:
            return False
        if self.guard is not None:
            self.guard.forget(path)
        try:
            if os.lstat(path).st_ino != BTRFS_FIRST_FREE_OBJECTID:  # only subvolume roots
                return False
        except FileNotFoundError:
            return False
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, BTRFS_IOC_SNAP_DESTROY, _vol_args(path.name))
        finally:
            os.close(parent)
        return True

    def usage(self, qgroup: int) -> DiskUsage | None:
        """Bytes charged to ``qgroup`` and its limit, from sysfs (no ioctl, no fork)."""
        if not qgroup or self._qgroups_sysfs is None:
            return None
        base = self._qgroups_sysfs / f"0_{qgroup}"
        try:
            used = int((base / "referenced").read_text())
            raw = (base / "max_referenced").read_text().strip()
        except (OSError, ValueError):
            return None
        limit = int(raw) if raw.isdigit() else 0
        return DiskUsage(used, limit)

    def used_bytes(self, qgroup: int) -> int | None:
        """Bytes charged to ``qgroup`` (committed ones), None if it is gone."""
        usage = self.usage(qgroup)
        return None if usage is None else usage.used

    def qgroups(self) -> dict[int, DiskUsage]:
        """Every sandbox quota group the kernel still tracks (leak checks)."""
        return qgroups(self.mount_point) if self.enabled else {}


def fsid(mount_point: Path) -> str:
    """The btrfs file system id (names its /sys/fs/btrfs directory)."""
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(1024)  # struct btrfs_ioctl_fs_info_args: max_id, num_devices, fsid
        fcntl.ioctl(fd, BTRFS_IOC_FS_INFO, buf)
    finally:
        os.close(fd)
    return str(uuid.UUID(bytes=bytes(buf[16:32])))


def qgroups(mount_point: Path) -> dict[int, DiskUsage]:
    """Level-0 quota groups of subvolumes (ids > 5) of the btrfs at ``mount_point``."""
    out: dict[int, DiskUsage] = {}
    base = Path(f"/sys/fs/btrfs/{fsid(mount_point)}/qgroups")
    if not base.is_dir():
        return out
    for entry in os.scandir(base):
        level, _, ident = entry.name.partition("_")
        if level != "0" or not ident.isdigit() or int(ident) <= 5:
            continue
        try:
            used = int((base / entry.name / "referenced").read_text())
            raw = (base / entry.name / "max_referenced").read_text().strip()
        except (OSError, ValueError):
            continue
        out[int(ident)] = DiskUsage(used, int(raw) if raw.isdigit() else 0)
    return out


def sync(mount_point: Path) -> None:
    """Commit the current transaction, which also wakes the cleaner that frees deleted
    subvolumes (and then their quota groups); otherwise that waits for the next commit."""
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SYNC)
    finally:
        os.close(fd)
