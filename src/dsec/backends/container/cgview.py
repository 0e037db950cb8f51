"""What crun sees at /sys/fs/cgroup: only the v1 hierarchies a sandbox joins.

crun 1.8 gives a container a cgroup in every v1 hierarchy whose /sys/fs/cgroup/NAME
exists for it (cgroup-setup.c, enter_cgroup_v1). On a host that mounts nine (here:
name=systemd, pids, blkio, freezer, devices, memory, cpuset, cpuacct, cpu) that was nine
cgroups per sandbox, and some cost kernel work that grows with the number of sandboxes
inside every create: a new cpuset walks every sibling cpuset and rebuilds the scheduler
domains' accounting. The platform uses six (CgroupHost.sandbox_hierarchies).

The view is one small tmpfs per edge, mounted once, holding an empty directory per
joined hierarchy. ``dsec-init crun-wrap --cgroup-view`` moves those hierarchies into it
and it over /sys/fs/cgroup, in crun's private mount namespace only (no new superblock
per call: a move, not a mount). Without "unified" in it crun runs in legacy v1 mode
and needs no empty cgroup.controllers mask either. ``--cgroup-park`` first puts crun
in the edge's park cgroups (CgroupHost.park_dirs) of the other hierarchies, so the
sandbox's processes stay there and its cgroup namespace is rooted in an empty cgroup.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from dsec import linux
from dsec.resources.cgroups import CgroupHost, Layout

VIEW_OPTIONS = "mode=0755,size=64k,nr_inodes=64"
log = logging.getLogger(__name__)


class CgroupView:
    """``open()`` mounts the view at ``path`` (anew: the list may have changed since an
    older edge made it); ``argv()`` is what crun-wrap needs for a call; ``close()``
    unmounts it. Inactive (no arguments) on a pure v2 host or one with no v1
    hierarchy to skip."""

    def __init__(self, path: Path, cgroups: CgroupHost, parent: str) -> None:
        self.path = path
        self.cgroups = cgroups
        self.parent = parent.strip("/")
        self.hierarchies = cgroups.sandbox_hierarchies() if cgroups.layout is not Layout.V2 else ()
        self.active = bool(self.hierarchies) and bool(
            cgroups.skipped_mounts() or cgroups.layout is Layout.HYBRID
        )
        # A co-mounted hierarchy (cpu,cpuacct) by each controller's name, as the host has
        self.aliases = {
            ctrl: mount.name
            for ctrl, mount in cgroups.v1.items()
            if mount.name in self.hierarchies and ctrl != mount.name and "=" not in ctrl
        }
        self.park: tuple[Path, ...] = ()
        self._mounted = False

    def open(self) -> None:
        """Mount the view and make the park cgroups. Where that fails crun sees every
        hierarchy, as before (logged): more cgroups per sandbox, nothing less safe."""
        if not self.active:
            return
        self.close()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            flags = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
            linux.mount("cgroup-view", self.path, "tmpfs", flags, VIEW_OPTIONS)
            self._mounted = True
            for name in self.hierarchies:
                (self.path / name).mkdir()
            for alias, name in self.aliases.items():  # crun opens /sys/fs/cgroup/cpu/...
                (self.path / alias).symlink_to(name)
            self.park = tuple(self.cgroups.ensure_park(self.parent))
        except OSError as exc:
            log.warning("crun sees every cgroup hierarchy (no view at %s: %s)", self.path, exc)
            self.close()

    def close(self) -> None:
        """Unmount the view (running sandboxes do not need it: crun uses it only while
        a call runs)."""
        if self._mounted or linux.is_mounted(self.path):
            linux.umount(self.path, detach=True)
        self._mounted = False
        with contextlib.suppress(OSError):
            self.path.rmdir()
        self.park = ()

    @property
    def in_use(self) -> bool:
        """crun-wrap gets the view (and crun then no unified hierarchy at all)."""
        return self._mounted

    def argv(self, *, starts_container: bool) -> list[str]:
        """crun-wrap's options: the view, and the park for a call that starts one."""
        if not self._mounted:
            return []
        argv = ["--cgroup-view", str(self.path)]
        if starts_container:
            for d in self.park:
                argv += ["--cgroup-park", str(d)]
        return argv
