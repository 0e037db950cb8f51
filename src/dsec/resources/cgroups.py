"""Which cgroup layout this host has, and the per-sandbox cgroup operations we need.

Our machines run a *hybrid* layout (every controller on v1, only hugetlb on v2);
production hosts are usually pure v2. The OCI runtime creates and removes a sandbox's
cgroups; this module reads them (usage, membership) and kills or removes what a crash
left behind, on either layout.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from enum import StrEnum
from functools import cache, cached_property
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
log = logging.getLogger(__name__)

#: The v1 controllers the platform uses for a sandbox: limits (memory, cpu, pids),
#: accounting (cpuacct), pause (freezer) and the device allow-list (devices). Nothing
#: sets a cpuset or a blkio limit, and nothing reads a sandbox's cpuset, blkio or
#: name=systemd cgroup, so a sandbox gets no cgroup there (see sandbox_hierarchies).
SANDBOX_CONTROLLERS = frozenset({"memory", "cpu", "cpuacct", "pids", "freezer", "devices"})


@cache
def _realpath(path: Path) -> str:
    return os.path.realpath(path)


class Layout(StrEnum):
    V1 = "v1"
    HYBRID = "hybrid"
    V2 = "v2"


@dataclass(frozen=True)
class CgroupHost:
    layout: Layout
    # v1 controller mount points (name -> directory), empty on pure v2
    v1: dict[str, Path]
    # the v2 hierarchy, if any (pure v2 root, or the hybrid 'unified' mount)
    v2: Path | None

    @property
    def crun_needs_empty_unified(self) -> bool:
        """crun 1.8 refuses a hybrid host whose v2 hierarchy has controllers."""
        if self.layout is not Layout.HYBRID or self.v2 is None:
            return False
        try:
            return bool((self.v2 / "cgroup.controllers").read_text().strip())
        except OSError:
            return False

    @property
    def has_cpu_idle(self) -> bool:
        """Whether the cpu controller has ``cpu.idle`` (kernel >= 5.15): a cgroup that
        competes with its siblings as one SCHED_IDLE entity (dsec.resources.qos)."""
        if "cpu" in self.v1:
            return (self.v1["cpu"] / "cpu.idle").exists()
        if self.layout is Layout.V2:
            major, minor = (int(x) for x in os.uname().release.split(".")[:2])
            return (major, minor) >= (5, 15)
        return False

    def dirs(self, rel: str) -> list[Path]:
        """Every directory that holds the cgroup ``rel`` (one per hierarchy)."""
        rel = rel.strip("/")
        mounts = list(self.v1.values())
        if self.v2 is not None:
            mounts.append(self.v2)
        # cpu and cpuacct are often co-mounted: dedupe by the mount's real path (cached:
        # cgroup file systems hold no symlinks, and a realpath per call was ~0.3 ms).
        seen: dict[str, Path] = {}
        for mount in mounts:
            seen.setdefault(_realpath(mount) + "/" + rel, mount / rel)
        return list(seen.values())

    @cached_property
    def _joined_mounts(self) -> tuple[Path, ...]:
        """Mount points of the v1 hierarchies a sandbox joins: those carrying one of
        SANDBOX_CONTROLLERS (a co-mount such as cpu,cpuacct,cpuset counts as used)."""
        seen: dict[str, Path] = {}
        for ctrl, mount in self.v1.items():
            if ctrl in SANDBOX_CONTROLLERS:
                seen.setdefault(_realpath(mount), mount)
        return tuple(seen.values())

    @cached_property
    def _hierarchy_order(self) -> tuple[str, ...]:
        joined = {m.name for m in self._joined_mounts}
        order: list[str] = []
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                parts = line.split(":", 2)
                if len(parts) < 3:
                    continue
                for ctrl in parts[1].split(","):
                    mount = self.v1.get(ctrl)
                    if mount is not None and mount.name in joined and mount.name not in order:
                        order.append(mount.name)
        return (*order, *sorted(joined - set(order)))

    def sandbox_hierarchies(self) -> tuple[str, ...]:
        """The v1 hierarchies a sandbox has a cgroup in, by their directory name under
        /sys/fs/cgroup, in the order crun 1.8 mounts them (the kernel's order in
        /proc/self/cgroup). Empty on a pure v2 host (one hierarchy, always joined).

        One decision for everything that touches a sandbox's cgroups: crun (only these
        are visible to it, see dsec-init crun-wrap --cgroup-view), the platform's own
        limited cgroups (create_limited), stats, freezer, and what the sandbox sees at
        /sys/fs/cgroup. Why skipping the rest loses nothing: every limit and reading
        the platform uses lives in these; in a skipped hierarchy the sandbox's
        processes stay in their parent's cgroup (the edge's, e.g. ``dsec/<edge>``),
        which sets no cpuset, weight or IO limit of its own, and whose cgroup.procs a
        sandbox reads through its own pid namespace (it sees its own pids only).
        Cleanup and leak checks still look at every hierarchy (dirs()): an older
        version's cgroups there are removed too."""
        return self._hierarchy_order

    def skipped_mounts(self) -> list[Path]:
        """Mount points of the v1 hierarchies a sandbox does not join (one each)."""
        joined = {_realpath(m) for m in self._joined_mounts}
        seen: dict[str, Path] = {}
        for mount in self.v1.values():
            real = _realpath(mount)
            if real not in joined:
                seen.setdefault(real, mount)
        return list(seen.values())

    def sandbox_dirs(self, rel: str) -> list[Path]:
        """The directories of the cgroup ``rel`` in the hierarchies a sandbox joins: the
        v1 ones of sandbox_hierarchies, or the v2 one on a pure v2 host. (A hybrid
        host's v2 hierarchy has no controller a sandbox uses: crun, started in legacy
        mode, makes no cgroup there.)"""
        rel = rel.strip("/")
        dirs = [m / rel for m in self._joined_mounts]
        if self.layout is Layout.V2 and self.v2 is not None:
            dirs.append(self.v2 / rel)
        return dirs

    def park_dirs(self, parent: str) -> list[Path]:
        """The cgroup ``parent`` in every hierarchy a sandbox does not join (the skipped
        v1 ones, and a hybrid host's v2 one): where the processes of a sandbox below
        ``parent`` stay there. Not the cgroup the platform runs in: that may be a
        service's, which its manager kills on stop (name=systemd, or v2 on a hybrid
        host), and a sandbox's cgroup namespace is rooted there (it would see the host's
        cgroups below it). An empty cgroup of the platform's shows nothing."""
        parent = parent.strip("/")
        mounts = self.skipped_mounts()
        if self.layout is Layout.HYBRID and self.v2 is not None:
            mounts.append(self.v2)
        return [m / parent for m in mounts]

    def ensure_park(self, parent: str) -> list[Path]:
        """Make park_dirs(parent) (idempotent; a v1 cpuset one is given its parent's
        cpus and mems, or it would refuse tasks) and return them."""
        parent = parent.strip("/")
        dirs = self.park_dirs(parent)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        cpuset = self.v1.get("cpuset")
        if cpuset is not None and cpuset not in self._joined_mounts:
            self._init_cpuset(parent)
        return dirs

    def member_dirs(self, rel: str) -> list[Path]:
        """Every cgroup a process of the sandbox ``rel`` belongs to: its own in the
        hierarchies it joins, its parent's park in the others (one per hierarchy)."""
        rel = rel.strip("/")
        return self.sandbox_dirs(rel) + self.park_dirs(rel.rpartition("/")[0])

    def _init_cpuset(self, rel: str) -> None:
        """v1 cpuset refuses tasks until cpus and mems are set, at every level."""
        level = self.v1["cpuset"]
        for part in rel.split("/"):
            child = level / part
            for key in ("cpuset.cpus", "cpuset.mems"):
                if not (child / key).read_text().strip():
                    (child / key).write_text((level / key).read_text())
            level = child

    def memory_usage(self, rel: str) -> int | None:
        rel = rel.strip("/")
        candidates = []
        if "memory" in self.v1:
            candidates.append(self.v1["memory"] / rel / "memory.usage_in_bytes")
        if self.layout is Layout.V2 and self.v2 is not None:
            candidates.append(self.v2 / rel / "memory.current")
        for path in candidates:
            try:
                return int(path.read_text())
            except (OSError, ValueError):
                continue
        return None

    def cpu_seconds(self, rel: str) -> float | None:
        """CPU time the cgroup's processes used so far (user + system), or None."""
        rel = rel.strip("/")
        if self.layout is Layout.V2 and self.v2 is not None:
            with contextlib.suppress(OSError, ValueError):
                for line in (self.v2 / rel / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
        for name in ("cpuacct", "cpu,cpuacct", "cpu"):
            if name in self.v1:
                with contextlib.suppress(OSError, ValueError):
                    return int((self.v1[name] / rel / "cpuacct.usage").read_text()) / 1e9
        return None

    def pids(self, rel: str) -> set[int]:
        """Every process in the cgroup or any cgroup below it (crun may nest, and an
        edge's cgroup holds its sandboxes' below it)."""
        found: set[int] = set()
        for d in self.dirs(rel):
            for root, _dirs, _files in os.walk(d):
                with contextlib.suppress(OSError, ValueError):
                    found.update(int(x) for x in Path(root, "cgroup.procs").read_text().split())
        return found

    def kill_all(self, rel: str, *, timeout: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup until it is empty (pids, never a
        remembered pid: that may have been reused by an unrelated process)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(rel)
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def drop_charges(self, rel: str) -> None:
        """Reclaim the page cache charged to an emptied cgroup before it is removed.

        Pages a sandbox read first (shared layer files) stay charged to its memory
        cgroup after rmdir, which keeps it alive as a *dying* cgroup. Measured here:
        ~600 of them slowed every create from 9 to 30-50 ms until the cache was
        dropped. v1 has memory.force_empty for exactly this; v2 has memory.reclaim.
        """
        rel = rel.strip("/")
        if "memory" in self.v1:
            with contextlib.suppress(OSError):
                (self.v1["memory"] / rel / "memory.force_empty").write_text("0")
        elif self.layout is Layout.V2 and self.v2 is not None:
            usage = self.memory_usage(rel)
            if usage:
                with contextlib.suppress(OSError):
                    (self.v2 / rel / "memory.reclaim").write_text(str(usage))

    def remove_if_empty(self, rel: str) -> None:
        """rmdir without killing anything: a shared parent stays if anyone uses it."""
        for d in self.dirs(rel):
            with contextlib.suppress(OSError):
                d.rmdir()

    def kill_and_remove(self, rel: str, *, timeout: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup and remove it everywhere (crash cleanup)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(rel)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            removed = self._rmdir_tree(rel)
            if removed or time.monotonic() > deadline:
                return removed
            time.sleep(0.01)

    def _rmdir_tree(self, rel: str) -> bool:
        ok = True
        for d in self.dirs(rel):
            if not d.is_dir():
                continue
            # children first (crun may nest), deepest paths first
            subdirs = sorted(
                (Path(root) for root, _dirs, _files in os.walk(d)),
                key=lambda p: len(p.parts),
                reverse=True,
            )
            for sub in subdirs:
                try:
                    sub.rmdir()
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        ok = False
        return ok

    def create_limited(
        self,
        rel: str,
        *,
        memory_bytes: int,
        cpu_cores: float,
        pids: int | None = None,
        cpu_shares: int | None = None,
        cpu_idle: bool = False,
    ) -> list[Path]:
        """Make the cgroup ``rel`` in every hierarchy with a hard memory limit (no swap
        beyond it), a CPU quota of ``cpu_cores``, optionally a pids limit and a CPU
        weight (``cpu_shares`` as v1 shares, converted for v2 as crun does; ``cpu_idle``:
        the whole cgroup a SCHED_IDLE entity, where ``has_cpu_idle``), for a
        process the platform starts itself (a microVM's QEMU: crun makes containers'
        cgroups). Only in the hierarchies a sandbox joins (sandbox_hierarchies); the
        parent's park (park_dirs) stands for the others. Returns the ``cgroup.procs``
        files to write the process into, one per hierarchy (member_dirs). On failure
        leaves nothing behind."""
        rel = rel.strip("/")
        period = 100_000
        quota = max(1000, int(cpu_cores * period))
        made: list[Path] = []
        park: list[Path] = []
        try:
            for d in self.sandbox_dirs(rel):
                d.mkdir(parents=True, exist_ok=True)
                made.append(d)
            if "cpuset" in self.v1 and self.v1["cpuset"] in self._joined_mounts:
                self._init_cpuset(rel)
            park = self.ensure_park(rel.rpartition("/")[0])
            if "memory" in self.v1:
                m = self.v1["memory"] / rel
                (m / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    (m / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            if "cpu" in self.v1:
                c = self.v1["cpu"] / rel
                (c / "cpu.cfs_period_us").write_text(str(period))
                (c / "cpu.cfs_quota_us").write_text(str(quota))
                if cpu_shares is not None:
                    (c / "cpu.shares").write_text(str(cpu_shares))
                if cpu_idle:  # after the shares: an idle group refuses a weight
                    (c / "cpu.idle").write_text("1")
            if pids is not None and "pids" in self.v1:
                (self.v1["pids"] / rel / "pids.max").write_text(str(pids))
            if self.layout is Layout.V2 and self.v2 is not None:
                u = self.v2 / rel
                (u / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):
                    (u / "memory.swap.max").write_text("0")
                (u / "cpu.max").write_text(f"{quota} {period}")
                if cpu_shares is not None:
                    (u / "cpu.weight").write_text(str(v2_weight(cpu_shares)))
                if cpu_idle:
                    (u / "cpu.idle").write_text("1")
                if pids is not None:
                    (u / "pids.max").write_text(str(pids))
        except BaseException:
            self._rmdir_tree(rel)
            raise
        return [d / "cgroup.procs" for d in made + park]

    def children(self, rel: str) -> set[str]:
        """Names of child cgroups of ``rel`` in any hierarchy."""
        names: set[str] = set()
        for d in self.dirs(rel):
            with contextlib.suppress(OSError):
                names.update(e.name for e in os.scandir(d) if e.is_dir())
        return names


def v2_weight(shares: int) -> int:
    """crun's conversion of v1 cpu.shares (2..262144) to v2 cpu.weight (1..10000)."""
    return 1 + ((max(2, min(shares, 262144)) - 2) * 9999) // 262142


def favor_dynamic_modifications(host: CgroupHost) -> bool:
    """Turn on the cgroup2 ``favordynmods`` mount option (kernel >= 6.0), if off.

    Every sandbox start moves a process into a new cgroup, which write-locks a global
    percpu rwsem; in its default fast-path mode that waits for an RCU grace period,
    which is slow when the host was idle a moment before. Measured on our machines:
    a create that follows a 20-100 ms pause took 21-25 ms p50; with favordynmods
    10.5-11.4 ms, pause or not. The price, a slightly costlier fork/exit for every
    process, is the right trade on a host whose job is starting sandboxes. The option
    is global and stays set (a remount without it does not clear it).
    """
    if host.v2 is None:
        return False
    if "favordynmods" in _mount_options(host.v2):
        return True
    res = subprocess.run(
        ["mount", "-o", "remount,favordynmods", str(host.v2)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        log.warning("cannot set favordynmods on %s: %s", host.v2, res.stderr.strip())
        return False
    log.info("cgroup2 at %s now mounted with favordynmods", host.v2)
    return True


def _mount_options(point: Path) -> set[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            if left.split()[4] == str(point):
                fields = right.split()
                return set(fields[2].split(",")) if len(fields) > 2 else set()
    return set()


@cache
def detect() -> CgroupHost:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return CgroupHost(Layout.V2, {}, CGROUP_ROOT)
    v1: dict[str, Path] = {}
    v2: Path | None = None
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            point = left.split()[4]
            rfields = right.split()
            fstype, opts = rfields[0], rfields[2] if len(rfields) > 2 else ""
            if not point.startswith(str(CGROUP_ROOT)):
                continue
            if fstype == "cgroup2":
                v2 = Path(point)
            elif fstype == "cgroup":
                for opt in opts.split(","):
                    if (
                        opt.startswith("name=")
                        or (Path(point) / f"{opt}.stat").exists()
                        or opt
                        in (
                            "cpu",
                            "cpuacct",
                            "cpuset",
                            "memory",
                            "pids",
                            "freezer",
                            "devices",
                            "blkio",
                            "net_cls",
                            "net_prio",
                            "perf_event",
                            "hugetlb",
                            "rdma",
                            "misc",
                        )
                    ):
                        v1.setdefault(opt, Path(point))
    layout = Layout.HYBRID if v2 is not None else Layout.V1
    return CgroupHost(layout, v1, v2)
