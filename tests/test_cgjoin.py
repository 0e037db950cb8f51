"""A sandbox joins only the cgroup v1 hierarchies the platform uses (issue 19, density).

Real crun sandboxes on the session platform, and a real process in a cgroup made by
CgroupHost.create_limited (what a microVM's QEMU gets): each has a cgroup of its own in
exactly CgroupHost.sandbox_hierarchies(), sits in its parent's park in the others,
sees no other cgroup, keeps its limits and its freezer, and leaves nothing on stop.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.resources import cgroups
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

HOST = cgroups.detect()
JOB = f"job-cgjoin-{time.monotonic_ns()}"
needs_v1 = pytest.mark.skipif(not HOST.v1, reason="no cgroup v1 hierarchy on this host")


def membership(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup as {hierarchy directory name (or "unified"): path}."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, ctrls, path = line.split(":", 2)
        if not ctrls:
            out["unified"] = path
            continue
        first = ctrls.split(",")[0]
        mount = HOST.v1.get(first)
        out[mount.name if mount is not None else first] = path
    return out


def expected(rel: str) -> dict[str, str]:
    """Own cgroup in the joined hierarchies, the parent's everywhere else."""
    parent = rel.rpartition("/")[0]
    joined = set(HOST.sandbox_hierarchies())
    want = {p.name: (rel if p.name in joined else parent) for p in HOST.v1.values()}
    if HOST.layout is cgroups.Layout.HYBRID:
        want["unified"] = parent
    return want


@pytest.fixture(scope="module")
def sync(platform: PlatformProcess, busybox_image: str) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(platform.url, platform.api_key) as client:
        yield client


def test_the_platform_joins_what_it_uses() -> None:
    names = HOST.sandbox_hierarchies()
    used = {"memory", "cpu", "cpuacct", "pids", "freezer", "devices"}
    mounted = {c for c in HOST.v1 if c in used}
    assert {HOST.v1[c].name for c in mounted} == set(names)
    assert len(names) == len(set(names))
    # not cpuset, blkio or name=systemd: nothing sets or reads a sandbox's cgroup there
    for skipped in ("cpuset", "blkio", "name=systemd"):
        if skipped in HOST.v1:
            assert HOST.v1[skipped] in HOST.skipped_mounts()
            assert HOST.v1[skipped].name not in names


@needs_v1
def test_sandbox_cgroups_limits_freezer_and_stop(
    sync: DSecSyncClient, platform: PlatformProcess
) -> None:
    sb = sync.run_container(
        DSecContainerRunArgs(
            container_image="busybox:latest",
            memory_limit_mb=96,
            cpu_cores_limit=0.5,
            pids_limit=77,
            job_id=JOB,
        ),
        timeout=60,
    )
    rel = f"/dsec/{platform.edge_id}/{sb.id}"
    try:
        pid = int((platform.data_dir / "sandboxes" / sb.id / "init.pid").read_text())
        assert membership(pid) == expected(rel)
        for d in HOST.dirs(rel):
            assert d.is_dir() == (d in HOST.sandbox_dirs(rel)), d
        # limits where the platform reads them
        mem = HOST.v1["memory"] / rel.lstrip("/")
        assert int((mem / "memory.limit_in_bytes").read_text()) == 96 << 20
        cpu = HOST.v1["cpu"] / rel.lstrip("/")
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50_000
        assert int((cpu / "cpu.cfs_period_us").read_text()) == 100_000
        assert (HOST.v1["pids"] / rel.lstrip("/") / "pids.max").read_text().strip() == "77"
        # inside: its own cgroups at the namespace root, no cgroup of anyone else below
        r = sb.run_shell("cat /proc/self/cgroup; find /sys/fs/cgroup -mindepth 2 -type d")
        assert r.exit_code == 0, r
        lines = r.stdout.split()
        assert all(line.endswith(":/") for line in lines if ":" in line), r.stdout
        assert [line for line in lines if ":" not in line] == [], r.stdout
        # the pids limit holds (77 tasks at most, the shell and agent among them)
        r = sb.run_shell("for i in $(seq 100); do sleep 5 & done 2>&1 | head -1; wait")
        assert "fork" in r.stdout.lower() or "resource" in r.stdout.lower(), r
        # the freezer: pause stops it, resume lets it go on
        freezer = HOST.v1["freezer"] / rel.lstrip("/") / "freezer.state"
        assert sync.pause_job(JOB).paused == 1
        assert freezer.read_text().strip() == "FROZEN"
        sync.resume_job(JOB)
        assert freezer.read_text().strip() == "THAWED"
        assert sb.run_shell("echo ok").stdout.strip() == "ok"
    finally:
        sb.stop()
    deadline = time.monotonic() + 10
    while any(d.exists() for d in HOST.dirs(rel)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [d for d in HOST.dirs(rel) if d.exists()] == []


@needs_v1
def test_limited_cgroup_joins_the_same_and_older_leftovers_go() -> None:
    parent = f"dsec/cgjoin-{time.monotonic_ns()}"
    rel = f"{parent}/vm"
    procs = HOST.create_limited(rel, memory_bytes=64 << 20, cpu_cores=0.25, pids=50)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert sorted(p.parent for p in procs) == sorted(HOST.member_dirs(rel))
        for p in procs:
            p.write_text(str(proc.pid))
        assert membership(proc.pid) == expected(f"/{rel}")
        # a cgroup an older version made in a skipped hierarchy is removed as well
        old = f"{parent}/old-sandbox"
        for d in HOST.dirs(old):
            d.mkdir(parents=True)
        assert HOST.kill_and_remove(old, timeout=5)
        assert [d for d in HOST.dirs(old) if d.exists()] == []
    finally:
        proc.kill()
        proc.wait()
        assert HOST.kill_and_remove(parent, timeout=5)
        HOST.remove_if_empty("dsec")
    assert [d for d in HOST.dirs(parent) if d.exists()] == []


def test_co_mounted_and_pure_v2_hosts(tmp_path: Path) -> None:
    """The same decision on layouts this host does not have: cpu and cpuacct co-mounted
    (crun opens /sys/fs/cgroup/cpu/..., so the view links it), and pure v2 (one
    hierarchy, always joined, no view)."""
    from dsec.backends.container.cgview import CgroupView

    comount = tmp_path / "cpu,cpuacct"
    v1 = {
        "cpu": comount,
        "cpuacct": comount,
        "memory": tmp_path / "memory",
        "cpuset": tmp_path / "cpuset",
        "name=systemd": tmp_path / "systemd",
    }
    host = cgroups.CgroupHost(cgroups.Layout.HYBRID, v1, tmp_path / "unified")
    assert set(host.sandbox_hierarchies()) == {"cpu,cpuacct", "memory"}
    assert host.sandbox_dirs("/dsec/e/s") == [comount / "dsec/e/s", tmp_path / "memory/dsec/e/s"]
    assert host.park_dirs("dsec/e") == [
        tmp_path / "cpuset/dsec/e",
        tmp_path / "systemd/dsec/e",
        tmp_path / "unified/dsec/e",
    ]
    assert host.member_dirs("dsec/e/s") == host.sandbox_dirs("dsec/e/s") + host.park_dirs("dsec/e")
    view = CgroupView(tmp_path / "view", host, "dsec/e")
    assert view.active and view.aliases == {"cpu": "cpu,cpuacct", "cpuacct": "cpu,cpuacct"}
    assert view.argv(starts_container=True) == []  # not mounted: crun sees everything

    v2 = cgroups.CgroupHost(cgroups.Layout.V2, {}, tmp_path)
    assert v2.sandbox_hierarchies() == () and v2.park_dirs("dsec/e") == []
    assert v2.member_dirs("dsec/e/s") == [tmp_path / "dsec/e/s"]
    assert not CgroupView(tmp_path / "view", v2, "dsec/e").active
