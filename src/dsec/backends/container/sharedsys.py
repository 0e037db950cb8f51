"""One read-only /sys per platform, shared by every container sandbox (issue 19).

Why: a sandbox used to mount a sysfs of its own (the kernel makes one per network
namespace) and, on a hybrid cgroup host, crun made a tmpfs at /sys/fs/cgroup to hold
one read-only bind per v1 hierarchy: two superblocks per sandbox. Every superblock
registers a memory-cgroup-aware shrinker, and every memory cgroup on the host keeps a
slot for every shrinker id ever alive at once, so each superblock a sandbox owns makes
every other sandbox's memory cgroup bigger (O(N^2) in total), and every 64 new ids the
kernel re-allocates the map of every memory cgroup inside a create.

What: the platform mounts one sysfs, read-only, from a blank network namespace it
creates (sysfs takes the mounting thread's namespace), applies every /sys mask to it
once (binds of the shared empty directory and of /dev/null, as crun did in every
sandbox), and mounts a small read-only skeleton at its fs/cgroup: one empty directory
per v1 hierarchy a sandbox joins (CgroupHost.sandbox_hierarchies), named as crun names
them, and crun's symlinks to those. Each
sandbox gets one recursive read-only bind of that tree (one mount call instead of
~17) and read-only binds of its own cgroup directories onto the skeleton's entries:
crun has created the cgroups by the time it performs the mounts, so the sandbox reads
the same files there as before (memory.limit_in_bytes at /sys/fs/cgroup/memory).
On a cgroup v2 host the sandbox keeps crun's "cgroup" mount (cgroup2 mounts of one
host share one superblock), on top of the shared tree. The skeleton is a tmpfs of the
platform's (one superblock per host, not per sandbox) rather than a bound directory
of the host's disk: a bind would show that directory's host path in every sandbox's
mountinfo.

A sysfs holds its network namespace only passively: the namespace would die (and
/sys/class/net go empty) once the thread that made it left. A bind of the namespace
(an nsfs file, no superblock of its own) inside the skeleton keeps it alive exactly as
long as any copy of the tree exists; it sits under a directory every sandbox covers
with a mount of its own (its cpu cgroup on v1, the cgroup2 mount on v2), so no sandbox
can reach it.

What a sandbox sees differently: /sys/class/net (and /sys/devices/virtual/net) list
the blank namespace's loopback only, not the sandbox's own interfaces (the eth0 of a
sandbox with network rules). Acceptable: sysfs's network class is the only part of
/sys that depends on the reader's network namespace; programs list and configure
interfaces through netlink and ioctls, and /proc/net (per namespace of the reader, not
of a mount) keeps every counter. /sys/fs/cgroup itself is read-only now (crun's tmpfs
was writable by root inside); nothing else changes.

The tree lives at ``<data_dir>/run/sys``, stacked on a bind of that directory onto
itself that is made private first, so nothing of it propagates to other mount
namespaces of the host. The platform unmounts it when it stops; the leftover of a
killed platform is found and replaced when the next one starts. Running sandboxes hold
their own copy of the tree (it is in their mount namespace), so they keep it across
platform restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from dsec import linux
from dsec.backends.container.oci_spec import mask_dir, sys_masks
from dsec.net.netns import in_blank_netns
from dsec.resources.cgroups import CGROUP_ROOT, CgroupHost, Layout

DIR_NAME = "sys"
_HARDEN = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
# crun's libcrun_cgroups_create_symlinks(): made where the name is not taken already.
V1_SYMLINKS = (
    ("cpu", "cpu,cpuacct"),
    ("cpuacct", "cpu,cpuacct"),
    ("net_cls", "net_cls,net_prio"),
    ("net_prio", "net_cls,net_prio"),
)
# crun's spelling of co-mounted controllers, whichever order /proc/self/cgroup has.
_COMOUNTS = {"net_prio,net_cls": "net_cls,net_prio", "cpuacct,cpu": "cpu,cpuacct"}
SKELETON_OPTIONS = "mode=0755,size=4k,nr_inodes=64"
log = logging.getLogger(__name__)


def v1_names(proc_self_cgroup: str) -> list[str]:
    """The directories crun 1.8.1 makes under /sys/fs/cgroup on a v1 or hybrid host
    (do_mount_cgroup_v1): one per line of /proc/self/cgroup that names controllers,
    ``name=`` dropped, co-mounted controllers in crun's order."""
    names: list[str] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[1]:
            continue  # the unified hierarchy ("0::/...")
        sub = parts[1]
        at = sub.find("name=")
        if at >= 0:
            sub = sub[at + len("name=") :]
        sub = _COMOUNTS.get(sub, sub)
        if sub and "/" not in sub and sub not in (".", "..") and sub not in names:
            names.append(sub)
    return names


def _bind_ro(source: str | os.PathLike[str], target: Path, flags: int) -> None:
    linux.mount(source, target, "", linux.MS_BIND)
    linux.mount("", target, "", linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | flags)


def remove(path: Path) -> bool:
    """Unmount the tree at ``path`` (every layer stacked there, with all below it).
    True if anything was mounted there."""
    found = False
    for _ in range(16):  # the tree and its anchor; more only after repeated crashes
        if not linux.is_mounted(path):
            break
        found = True
        linux.umount(path, detach=True)
    return found


def leftovers(data_dir: Path) -> list[str]:
    """A shared /sys still mounted below ``data_dir`` (for leak checks)."""
    path = data_dir / "run" / DIR_NAME
    return [f"shared sysfs {path}"] if linux.is_mounted(path) else []


def remove_leftovers(data_dir: Path) -> None:
    """Unmount what leftovers() reports (a platform killed before it could)."""
    with contextlib.suppress(OSError):
        remove(data_dir / "run" / DIR_NAME)


class SharedSys:
    """The platform's read-only /sys and what each sandbox mounts of it."""

    def __init__(self, run_dir: Path, cgroups: CgroupHost) -> None:
        self.path = run_dir / DIR_NAME
        self.cgroups = cgroups
        self.active = False
        self._v1: list[str] = []  # hierarchies a sandbox gets its own cgroup bound at
        self._netns_fd: int | None = None  # holds the namespace where no pin is hidden

    def open(self) -> None:
        """Mount the tree (replacing a leftover of a killed platform). On failure
        nothing stays mounted and the error is raised."""
        if remove(self.path):
            log.info("replaced the shared /sys a previous platform left at %s", self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            linux.mount(self.path, self.path, "", linux.MS_BIND)
            linux.mount("", self.path, "", linux.MS_PRIVATE)
            netns = in_blank_netns(self._mount_sysfs)
            try:
                self._mask()
                self._skeleton(netns)
            finally:
                if self._netns_fd != netns:
                    os.close(netns)
        except BaseException:
            with contextlib.suppress(OSError):
                remove(self.path)
            raise
        self.active = True

    def _mount_sysfs(self) -> int:
        """(In the blank namespace.) Mount the sysfs; an fd of the namespace."""
        linux.mount("sysfs", self.path, "sysfs", linux.MS_RDONLY | _HARDEN)
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmount the tree; sandboxes still running keep their own copy of it."""
        self.active = False
        remove(self.path)
        if self._netns_fd is not None:
            os.close(self._netns_fd)
            self._netns_fd = None

    def _inside(self, sys_path: str) -> Path | None:
        """``sys_path`` (under /sys) in the shared tree, if it exists there and
        resolves inside it."""
        root = os.path.realpath(self.path)
        real = os.path.realpath(os.path.join(root, sys_path.removeprefix("/sys/")))
        if not real.startswith(root + "/") or not os.path.lexists(real):
            return None
        return Path(real)

    def _mask(self) -> None:
        files, dirs = sys_masks()
        empty = mask_dir()
        for d in dirs:
            target = self._inside(d)
            if target is not None and target.is_dir():
                _bind_ro(empty, target, _HARDEN)
        for f in files:
            target = self._inside(f)
            if target is not None and not target.is_dir():
                # as crun masks a file: /dev/null, read-only (reads return nothing)
                _bind_ro("/dev/null", target, linux.MS_NOSUID | linux.MS_NOEXEC)

    def _skeleton(self, netns: int) -> None:
        """The read-only tmpfs at fs/cgroup: crun's v1 names (none on v2) and the
        hidden pin of the blank network namespace."""
        target = self.path / "fs" / "cgroup"
        names = []
        if self.cgroups.layout is not Layout.V2:
            with open("/proc/self/cgroup", encoding="utf-8") as fh:
                names = v1_names(fh.read())
            # only the hierarchies a sandbox has a cgroup in (the others it does not see)
            joined = set(self.cgroups.sandbox_hierarchies())
            names = [n for n in names if n in joined]
        linux.mount("tmpfs", target, "tmpfs", _HARDEN, SKELETON_OPTIONS)
        for name in names:
            (target / name).mkdir()
            (target / name).chmod(0o755)
        for name, dest in V1_SYMLINKS:
            if dest in names and not os.path.lexists(target / name):
                os.symlink(dest, target / name)
        self._v1 = [n for n in names if (CGROUP_ROOT / n).is_dir()]
        # Covered in every sandbox: by its first cgroup bind (v1), by cgroup2 (v2).
        hide = target / self._v1[0] if self._v1 else target
        if self._v1 or self.cgroups.layout is Layout.V2:
            pin = hide / ".netns"
            pin.touch(mode=0o400)
            linux.mount(f"/proc/self/fd/{netns}", pin, "", linux.MS_BIND)
        else:
            self._netns_fd = netns  # nowhere hidden: the platform holds it meanwhile
        linux.mount("", target, "", linux.MS_REMOUNT | linux.MS_RDONLY | _HARDEN)

    def sandbox_mounts(self, cgroup_path: str) -> list[dict[str, Any]]:
        """The OCI mounts of /sys for the sandbox in cgroup ``cgroup_path``."""
        opts = ["nosuid", "noexec", "nodev"]
        out: list[dict[str, Any]] = [
            {"destination": "/sys", "type": "bind", "source": str(self.path),
             "options": ["rbind", "ro", *opts]},
        ]  # fmt: skip
        if self.cgroups.layout is Layout.V2:
            out.append(
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
                 "options": [*opts, "relatime", "ro"]}
            )  # fmt: skip
            return out
        rel = cgroup_path.strip("/")
        out += [
            {"destination": f"/sys/fs/cgroup/{name}", "type": "bind",
             "source": str(CGROUP_ROOT / name / rel), "options": ["bind", "ro", *opts]}
            for name in self._v1
        ]  # fmt: skip
        return out
