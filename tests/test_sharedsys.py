"""The platform's shared read-only /sys (dsec.backends.container.sharedsys, issue 19):
a sandbox owns no sysfs or tmpfs superblock for /sys, every /sys mask still holds,
/sys is read-only, shows no host interface and nothing of another sandbox, the
sandbox's own cgroup files read as before, and a killed platform's tree is replaced
on restart (running sandboxes keep theirs) and cleaned by the leak checks."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxState, linux
from dsec.backends.container import sharedsys
from dsec.backends.container.oci_spec import sys_masks
from dsec.resources import cgroups
from dsec.resources.capacity import SandboxCost
from dsec.sdk.client import Sandbox
from tests.conftest import clean_leftovers, host_leaks, platform_process

pytestmark = pytest.mark.root

MIB64 = 64 * 1024 * 1024


def spec(image: str, **kw: Any) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=64, **kw)


def superblocks(mountinfo: str) -> dict[str, tuple[str, str]]:
    """device -> (fs type, first mount point) of each distinct superblock."""
    out: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        out.setdefault(fields[2], (right.split()[0], fields[4]))
    return out


@pytest.fixture
async def two(client: DSecClient, busybox_image: str) -> AsyncIterator[tuple[Sandbox, Sandbox]]:
    a = await client.run_container(spec(busybox_image))
    try:
        b = await client.run_container(spec(busybox_image, network_rules={"pypi": False}))
        try:
            yield a, b
        finally:
            await b.stop()
    finally:
        await a.stop()


async def test_no_sysfs_or_tmpfs_superblock_of_its_own(two: tuple[Sandbox, Sandbox]) -> None:
    a, _ = two
    info = (await a.read_file("/proc/self/mountinfo")).decode()
    host = await asyncio.to_thread(lambda: superblocks(Path("/proc/self/mountinfo").read_text()))
    own = {dev: v for dev, v in superblocks(info).items() if dev not in host}
    kinds = sorted(fstype for fstype, _ in own.values())
    # overlay root, proc, /dev (with /dev/shm in it: tests/test_devfs.py), devpts,
    # mqueue: nothing for /sys any more
    assert kinds == ["devpts", "mqueue", "overlay", "proc", "tmpfs"], own
    # what admission's memory arithmetic counts for each sandbox's shrinker map
    assert len(own) == SandboxCost().superblocks
    assert {point for fstype, point in own.values() if fstype == "tmpfs"} == {"/dev"}
    sys_line = next(line for line in info.splitlines() if line.split()[4] == "/sys")
    assert " - sysfs " in sys_line and sys_line.split()[2] in host, sys_line


async def test_every_sys_mask_holds_and_sys_is_read_only(two: tuple[Sandbox, Sandbox]) -> None:
    a, _ = two
    files, dirs = sys_masks()
    assert dirs, "this host has masked directories under /sys"
    script = "".join(f"echo \"$(ls -A '{d}' 2>/dev/null | wc -l) {d}\";" for d in dirs)
    script += "".join(f"echo \"$(cat '{f}' 2>/dev/null | wc -c) {f}\";" for f in files)
    res = await a.run_shell(script)
    assert len(res.stdout.splitlines()) == len(dirs) + len(files), res
    assert all(line.startswith("0 ") for line in res.stdout.splitlines()), res.stdout
    res = await a.run_shell(
        "touch /sys/x; touch /sys/fs/cgroup/x; mkdir /sys/fs/cgroup/y;"
        f" mkdir '{dirs[0]}/x'; echo 1 > /sys/kernel/mm/transparent_hugepage/enabled;"
        " echo 1 > /sys/fs/cgroup/memory/memory.limit_in_bytes;"
        " mount -o remount,rw /sys && echo REMOUNTED; mount -o remount,rw /sys/fs/cgroup &&"
        f" echo REMOUNTED; umount /sys/fs/cgroup/memory && echo UNMOUNTED; umount '{dirs[0]}'"
        " && echo UNMOUNTED; ls -A /sys/fs/cgroup | grep -v -x -e . -e .. | wc -l; true"
    )
    out = res.stdout + res.stderr
    assert "REMOUNTED" not in out and "UNMOUNTED" not in out, out
    assert out.count("Read-only file system") >= 6, out
    if cgroups.detect().layout is not cgroups.Layout.V2:  # crun's names only, no write
        text = await asyncio.to_thread(Path("/proc/self/cgroup").read_text)
        joined = set(cgroups.detect().sandbox_hierarchies())  # the joined ones only
        names = [n for n in sharedsys.v1_names(text) if n in joined]
        names += [n for n, dest in sharedsys.V1_SYMLINKS if dest in names and n not in names]
        assert res.stdout.split()[-1] == str(len(names)), res


async def test_no_host_interface_nothing_of_another_sandbox(
    two: tuple[Sandbox, Sandbox],
) -> None:
    a, b = two
    for sb in (a, b):  # b has a network of its own (eth0): /sys shows the blank one's lo
        res = await sb.run_shell(
            "ls /sys/class/net; cat /sys/fs/cgroup/memory/memory.limit_in_bytes;"
            " cat /proc/self/cgroup"
        )
        lines = res.stdout.splitlines()
        assert lines[0] == "lo" and lines[1] == str(MIB64), res
        assert all(line.endswith(":/") for line in lines[2:]), res
    host_links = await asyncio.to_thread(os.listdir, "/sys/class/net")
    assert set(host_links) - {"lo"}, "the host has interfaces of its own"
    res = await a.run_shell(
        f"grep -rls -e '{b.id}' /sys/fs/cgroup /proc/self/mountinfo 2>/dev/null | head;"
        f" find /sys/fs /sys/kernel -name '*{b.id}*' 2>/dev/null | head"
    )
    assert b.id not in res.stdout, res


def _stacked(path: Path) -> list[str]:
    real = os.path.realpath(path)
    return [m.fstype for m in linux.mounts(real) if m.mount_point == real]


def test_tree_is_private_replaced_when_left_over_and_cleaned() -> None:
    """The tree alone (no platform): a leftover is replaced, not stacked on; the leak
    checks name it and clean it."""
    base = Path(tempfile.mkdtemp(prefix="dsec-sys-", dir="/tmp"))
    try:
        tree = sharedsys.SharedSys(base / "run", cgroups.detect())
        tree.open()
        first = _stacked(tree.path)
        assert len(first) == 2 and first[-1] == "sysfs", first  # anchor, then the sysfs
        # Private: no shared or slave propagation on any mount of the tree.
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                if str(tree.path) in line.split(" - ")[0]:
                    assert "shared:" not in line and "master:" not in line, line
        assert os.listdir(tree.path / "class" / "net") == ["lo"]  # the pinned blank netns
        again = sharedsys.SharedSys(base / "run", cgroups.detect())  # a restarted platform
        again.open()
        assert _stacked(again.path) == first
        edge = "t" + secrets.token_hex(4)
        assert f"shared sysfs {tree.path}" in host_leaks(base, edge)
        clean_leftovers(base, edge)
        assert not sharedsys.leftovers(base) and not linux.mounts(base)
    finally:
        sharedsys.remove_leftovers(base)
        for m in reversed(linux.mounts(base)):
            linux.umount(m.mount_point, detach=True)
        shutil.rmtree(base, ignore_errors=True)


async def test_running_sandbox_keeps_its_sys_across_a_killed_platform() -> None:
    with platform_process() as plat:
        async with DSecClient(plat.url, plat.api_key) as client:
            await client.build_image("busybox")
            sb = await client.run_container(spec("busybox:latest"))
        plat.kill()
        assert sharedsys.leftovers(plat.data_dir), "a killed platform leaves its tree"
        plat.start()
        tree = plat.data_dir / "run" / sharedsys.DIR_NAME
        assert len(_stacked(tree)) == 2, _stacked(tree)  # replaced, not stacked on
        async with DSecClient(plat.url, plat.api_key) as client:
            kept = await client.get(sb.id)
            assert kept.info.state is SandboxState.RUNNING
            newer = await client.run_container(spec("busybox:latest"))
            for s in (kept, newer):
                res = await s.run_shell(
                    "ls /sys/class/net; cat /sys/fs/cgroup/memory/memory.limit_in_bytes;"
                    " ls /sys/firmware | wc -l"
                )
                assert res.stdout.split() == ["lo", str(MIB64), "0"], res
            await kept.stop()
            await newer.stop()
