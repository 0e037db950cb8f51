"""Writable-disk quotas and resource-limit events, on a real platform (no mocks).

Each attempt runs as root inside a sandbox and must (1) be stopped by the kernel,
(2) leave the host and a neighbouring sandbox unaffected, (3) raise a
``resource_limit`` event naming the limit. The platform runs with a small (4 GiB,
preallocated) sandbox disk; the leak checks of ``platform_process`` also cover its mount and
loop device, and the last test checks that no quota group outlives its sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient, linux
from dsec.errors import LimitExceeded
from dsec.resources import cgroups, disk
from dsec.security.limits import LimitWatcher, read_cgroup_counters
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process(DSEC_SANDBOX_DISK_GB="4") as p:
        yield p


@pytest.fixture(scope="module")
def client(plat: PlatformProcess) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(plat.url, plat.api_key) as c:
        c.build_image("busybox")
        yield c


@pytest.fixture(scope="module")
def neighbour(client: DSecSyncClient) -> Iterator[Any]:
    """A well-behaved sandbox that must keep working while the others misbehave."""
    sb = client.run_container(run_args(), timeout=60)
    yield sb
    sb.stop()


def run_args(**kw: Any) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 128)
    return DSecContainerRunArgs.model_validate(
        {"container_image": "busybox:latest", "job_id": "limits-test", **kw}
    )


def limit_events(
    plat: PlatformProcess, sandbox_id: str, limit: str, wait: float = 8.0
) -> list[dict[str, Any]]:
    """``resource_limit`` events of one sandbox from the audit store (flushed every 50 ms;
    the periodic scan runs every 2 s)."""
    deadline = time.monotonic() + wait
    while True:
        db = sqlite3.connect(f"file:{plat.data_dir / 'audit.db'}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT detail FROM audit WHERE sandbox = ? AND event = 'resource_limit'",
                (sandbox_id,),
            ).fetchall()
        finally:
            db.close()
        found = [d for (text,) in rows if (d := json.loads(text)).get("limit") == limit]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def host_free(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def neighbour_ok(sb: Any) -> None:
    r = sb.run_shell("echo hi > /tmp/n && dd if=/dev/zero of=/tmp/n2 bs=1M count=8 && cat /tmp/n")
    assert r.exit_code == 0 and r.stdout.strip() == "hi", r


def test_disk_fill_stops_at_limit(
    plat: PlatformProcess, client: DSecSyncClient, neighbour: Any
) -> None:
    image = plat.data_dir / "sandboxes.img"
    host_bytes_before = image.stat().st_blocks * 512  # what the host pays for sandboxes
    sb = client.run_container(run_args(disk_limit_mb=64), timeout=60)
    try:
        r = sb.run_shell("dd if=/dev/zero of=/fill bs=1M count=300")
        assert r.exit_code != 0
        assert "quota exceeded" in r.stderr.lower() or "no space" in r.stderr.lower(), r
        size = int(sb.run_shell("stat -c %s /fill").stdout)
        assert 32 * MiB < size <= 64 * MiB
        neighbour_ok(neighbour)
        # The host gave at most the quota (plus file system metadata), not 300 MiB.
        disk.sync(plat.data_dir / "sandboxes")
        grown = image.stat().st_blocks * 512 - host_bytes_before
        assert grown < 100 * MiB, grown
        (ev,) = limit_events(plat, sb.id, "disk")
        assert ev["value"] == 64 * MiB and ev["used"] <= 64 * MiB
        # Freeing space frees the quota: the sandbox can write again.
        r = sb.run_shell("rm /fill && sync && dd if=/dev/zero of=/again bs=1M count=16")
        assert r.exit_code == 0, r
    finally:
        sb.stop()


def test_inode_exhaustion_stopped(
    plat: PlatformProcess, client: DSecSyncClient, neighbour: Any
) -> None:
    _, inodes_before = host_free(plat.data_dir)
    sb = client.run_container(run_args(disk_limit_mb=64), timeout=60)
    try:
        # Data fills 48 of the 64 MiB first, so the files meet the quota after ~5x10^4
        # instead of ~2x10^5 (a quota blind to metadata would let them run forever).
        # Shell built-in redirections only: no fork per file.
        r = sb.run_shell(
            "dd if=/dev/zero of=/fill bs=1M count=48 2>/dev/null && "
            "mkdir /many && cd /many && i=0; "
            "while true > f$i 2>/dev/null; do i=$((i+1)); done; echo $i",
            timeout=300,
        )
        assert r.stdout.strip(), r
        created = int(r.stdout.split()[-1])
        # btrfs charges metadata to the quota: ~350 bytes per empty file.
        assert 10_000 < created < 100_000, r
        _, inodes_after = host_free(plat.data_dir)
        # The files are not on the host: its inode count moves only with unrelated work.
        assert abs(inodes_before - inodes_after) < created // 4, (inodes_before, inodes_after)
        neighbour_ok(neighbour)
        assert sb.run_shell("touch /many/one-more").exit_code != 0
        assert limit_events(plat, sb.id, "disk")
    finally:
        sb.stop()


def test_fork_bomb_contained(plat: PlatformProcess, client: DSecSyncClient, neighbour: Any) -> None:
    sb = client.run_container(run_args(pids_limit=64), timeout=60)
    try:
        r = sb.run_shell("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=6)
        neighbour_ok(neighbour)
        (ev, *_more) = limit_events(plat, sb.id, "pids")
        assert ev["value"] == 64 and ev["refused_forks"] > 0
        assert r.timed_out or "can't fork" in r.stderr, r
        procs = cgroups.detect().pids(f"/dsec/{plat.edge_id}/{sb.id}")
        assert len(procs) <= 64
    finally:
        sb.stop()
    neighbour_ok(neighbour)


def test_memory_bomb_oom_killed(
    plat: PlatformProcess, client: DSecSyncClient, neighbour: Any
) -> None:
    sb = client.run_container(run_args(memory_limit_mb=64), timeout=60)
    try:
        r = sb.run_shell("dd if=/dev/zero of=/dev/null bs=256M count=1")
        assert r.exit_code == 137, r  # SIGKILL by the OOM killer
        (ev,) = limit_events(plat, sb.id, "memory")
        assert ev["value"] == 64 and ev["oom_kills"] >= 1
        assert sb.run_shell("echo alive").stdout.strip() == "alive"  # pid 1 survived
        neighbour_ok(neighbour)
    finally:
        sb.stop()


def test_background_oom_noticed_by_the_kernel_event(
    plat: PlatformProcess, client: DSecSyncClient
) -> None:
    """An OOM kill of a background process (its command exited 0, so no command
    reports it) is noticed from the kernel's notification, not a scan of every
    sandbox (dsec.resources.cgevents): well within the old 2 s scan period."""
    sb = client.run_container(run_args(memory_limit_mb=64), timeout=60)
    try:
        r = sb.run_shell("(dd if=/dev/zero of=/dev/null bs=256M count=1) >/dev/null 2>&1 &")
        assert r.exit_code == 0, r
        t = time.monotonic()
        (ev,) = limit_events(plat, sb.id, "memory")
        assert ev["value"] == 64 and ev["oom_kills"] >= 1
        assert time.monotonic() - t < 1.5
    finally:
        sb.stop()


def test_output_flood_truncated_and_timeout(
    plat: PlatformProcess, client: DSecSyncClient, neighbour: Any
) -> None:
    sb = client.run_container(run_args(), timeout=60)
    try:
        r = sb.run_shell("yes flood | head -c 100000000", max_output_bytes=1 * MiB)
        assert r.truncated and len(r.stdout) <= 1 * MiB
        assert limit_events(plat, sb.id, "output")
        r = sb.run_shell("sleep 30", timeout=0.5)
        assert r.timed_out
        assert limit_events(plat, sb.id, "timeout")
        neighbour_ok(neighbour)
        # A normal command raises nothing new.
        before = len(limit_events(plat, sb.id, "output", wait=0))
        assert sb.run_shell("echo fine").exit_code == 0
        assert len(limit_events(plat, sb.id, "output", wait=0)) == before
    finally:
        sb.stop()


def test_disk_limit_larger_than_host_is_refused(client: DSecSyncClient) -> None:
    with pytest.raises(LimitExceeded, match="disk_limit_mb"):
        client.run_container(run_args(disk_limit_mb=64 * 1024), timeout=60)


def test_no_quota_group_outlives_its_sandbox(
    plat: PlatformProcess, client: DSecSyncClient, neighbour: Any
) -> None:
    """Quota groups go with their sandboxes. The one warm sandbox of the shape
    (dsec.edge.warmpool: kept while a sandbox, here the neighbour, lives) is a sandbox
    started ahead: its directory is a quota group of its own, and it goes with it."""
    mount = plat.data_dir / "sandboxes"
    sbs = [client.run_container(run_args(disk_limit_mb=100), timeout=60) for _ in range(3)]
    groups = disk.qgroups(mount)
    assert len(groups) >= 4  # three new ones plus the neighbour
    assert sum(1 for u in groups.values() if u.limit == 100 * MiB) >= 3
    for sb in sbs:
        sb.stop()

    def warm() -> set[int]:
        """Quota groups of sandboxes started ahead: not listed, and their init runs (a
        stopped one's directory on its way out has a dead init)."""
        live = {s.id for s in client.list_sandboxes()}
        found = set()
        for d in mount.iterdir():
            with contextlib.suppress(OSError, ValueError):
                if d.name not in live and linux.pid_alive(int((d / "init.pid").read_text())):
                    found.add(disk.subvolume_id(d))
        return found

    deadline = time.monotonic() + 30
    while True:
        disk.sync(mount)  # wakes the cleaner that drops deleted subvolumes
        kept = warm()  # of every shape this module's tests made
        groups = disk.qgroups(mount)
        left = {q: u for q, u in groups.items() if u.limit == 100 * MiB and q not in kept}
        settled = len(groups) == 1 + len(kept)
        if (not left and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"quota groups left behind: {left}"
    assert sum(1 for q in kept if groups[q].limit == 100 * MiB) <= 1  # one warm a shape
    assert len(groups) == 1 + len(kept)  # the neighbour's and the warm ones'


def test_restart_keeps_data_and_quota() -> None:
    """A crashed platform's sandboxes are re-adopted on the same (still mounted) disk
    with their files and limits; a clean stop unmounts, a restart re-uses the image."""
    with platform_process(DSEC_SANDBOX_DISK_GB="2") as p:
        image = p.data_dir / "sandboxes.img"
        with DSecSyncClient(p.url, p.api_key) as c:
            c.build_image("busybox")
            sb = c.run_container(run_args(disk_limit_mb=64, ttl_running_stop=None), timeout=60)
            assert sb.run_shell("echo kept > /data").exit_code == 0
        ino = image.stat().st_ino
        p.kill()
        p.start()
        with DSecSyncClient(p.url, p.api_key) as c:
            again = c.get(sb.id)
            assert again.run_shell("cat /data").stdout.strip() == "kept"
            r = again.run_shell("dd if=/dev/zero of=/fill bs=1M count=200")
            assert r.exit_code != 0 and "quota" in r.stderr.lower(), r
            again.stop()
        p.stop()
        assert not (p.data_dir / "sandboxes").is_mount()
        p.start()
        assert image.stat().st_ino == ino  # re-used, not re-formatted
        assert (p.data_dir / "sandboxes").is_mount()


def test_watcher_raises_once_per_new_hit() -> None:
    """Unit check of the edge-triggered logic with the kernel's counter readings."""
    from dsec.resources.disk import DiskUsage
    from dsec.security.audit import AuditLog
    from dsec.security.limits import LimitReading

    readings = [
        LimitReading(0, 0, DiskUsage(0, 64 * MiB)),
        LimitReading(1, 0, DiskUsage(64 * MiB, 64 * MiB)),
        LimitReading(1, 0, DiskUsage(64 * MiB, 64 * MiB)),
        LimitReading(1, 5, DiskUsage(1 * MiB, 64 * MiB)),
        LimitReading(2, 5, DiskUsage(64 * MiB, 64 * MiB)),
    ]
    audit = AuditLog(None)
    rec = type("Rec", (), {"id": "x-0000000000000000", "spec": run_args()})()
    it = iter(readings)
    w = LimitWatcher(audit, lambda _rec: next(it))
    w.track(rec.id)
    for _ in readings:
        w.check(rec)
    got = [(e.detail["limit"]) for e in audit.events()]
    assert got == ["memory", "disk", "pids", "memory", "disk"]
    # An adopted sandbox (not tracked): the first reading is a baseline, not an event.
    w2 = LimitWatcher(audit, lambda _rec: LimitReading(3, 3, None))
    w2.check(rec)
    assert len(audit.events()) == 5
    # A cgroup that does not exist reads as "no counter", not as zero.
    assert read_cgroup_counters(cgroups.detect(), "/no-such-cgroup") == (None, None)
