"""Adversarial suite, class "leaks" (issue 12, item 6): what a sandbox sees of the host
and of other sandboxes (decisions per path in docs/HOST_VIEW.md).

Root inside reads every masked path (empty or refused), looks for another sandbox's
quota group and for the host's data directory in its mount table, reads the host's
identity (kernel command line, boot id), tries memfd_secret (refused and recorded),
and the same from a FnCall sandbox; honest tools (ps, top, free, df, Python's view of
the machine) keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, ProtectedMount
from dsec.api.events import EventKind
from dsec.api.fncall import DSecFnCallRunArgs
from dsec.backends.container.oci_spec import HOST_VIEW_MASKS, masked_paths
from dsec.errors import DSecError
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess
from tests.test_adversarial import ATTACK_IN_SANDBOX, attack_binary

pytestmark = pytest.mark.root


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def _read(path: str) -> str:
    return Path(path).read_text().strip()


__all__ = ["attack_binary"]  # the fixture, re-exported for pytest


@pytest.fixture
async def pair(
    client: DSecClient, busybox_image: str, attack_binary: Path
) -> AsyncIterator[tuple[Sandbox, Sandbox, str]]:
    """An attacker (own job, protected path, own network namespace) and a neighbour
    that writes to its disk, so it has a quota group with data in it."""
    job = "leak-" + secrets.token_hex(4)
    attacker = await client.run_container(
        DSecContainerRunArgs(
            container_image=busybox_image,
            memory_limit_mb=64,
            disk_limit_mb=128,
            job_id=job,
            network_rules={"pypi": False},
            protected=[ProtectedMount(path="/answers", files={"a.txt": "42"})],
        )
    )
    neighbour: Sandbox | None = None
    try:
        neighbour = await client.run_container(
            DSecContainerRunArgs(
                container_image=busybox_image, memory_limit_mb=64, disk_limit_mb=128
            )
        )
        await neighbour.run_shell("head -c 3000000 /dev/zero > /root/blob; sync")
        await attacker.write_file(
            ATTACK_IN_SANDBOX, await asyncio.to_thread(attack_binary.read_bytes), mode=0o755
        )
        yield attacker, neighbour, job
    finally:
        for sb in (attacker, neighbour):
            if sb is not None:
                with contextlib.suppress(DSecError):
                    await sb.stop()


async def test_every_masked_path_is_empty_inside(pair: tuple[Sandbox, Sandbox, str]) -> None:
    attacker, _, _ = pair
    paths = await asyncio.to_thread(_existing, masked_paths())
    assert set(await asyncio.to_thread(_existing, HOST_VIEW_MASKS)) <= set(paths)
    script = "".join(
        f"if [ -d '{p}' ]; then n=$(ls -A '{p}' | wc -l);"
        f" else n=$(cat '{p}' 2>/dev/null | wc -c); fi; echo \"$n {p}\";"
        for p in paths
    )
    res = await attacker.run_shell(script)
    leaking = [line for line in res.stdout.splitlines() if not line.startswith("0 ")]
    assert not leaking, leaking
    assert len(res.stdout.splitlines()) == len(paths)
    # Masked directories are one shared read-only empty directory, bound (no
    # superblock each: every superblock costs every memory cgroup a shrinker slot).
    dirs = await asyncio.to_thread(lambda: [p for p in paths if os.path.isdir(p)])
    res = await attacker.run_shell(
        "".join(f"mkdir '{d}/x' 2>/dev/null && echo 'wrote {d}';" for d in dirs)
        + "cat /proc/self/mountinfo"
    )
    assert "wrote" not in res.stdout, res.stdout
    host_info = await asyncio.to_thread(Path("/proc/self/mountinfo").read_text)
    host = {line.split()[2] for line in host_info.splitlines()}
    own = {line.split()[2] for line in res.stdout.splitlines()} - host
    # overlay, proc, /dev (and /dev/shm: one tmpfs), devpts, mqueue; /sys is the
    # platform's shared one (dsec.backends.container.sharedsys), no sysfs or cgroup
    # tmpfs of its own
    assert len(own) <= 5, res.stdout


async def test_no_other_sandbox_quota_group_or_disk_is_visible(
    pair: tuple[Sandbox, Sandbox, str],
) -> None:
    attacker, neighbour, _ = pair
    # On the host every sandbox's quota group is listed (so the test means something).
    host_qgroups = await asyncio.to_thread(
        lambda: list(Path("/sys/fs/btrfs").glob("*/qgroups/0_*"))
    )
    assert len(host_qgroups) >= 2, host_qgroups
    res = await attacker.run_shell(
        "ls -A /sys/fs/btrfs | wc -l; find /sys /proc/fs -name 'qgroup*' 2>/dev/null | wc -l;"
        " cat /sys/block/*/stat /sys/class/block/*/stat 2>/dev/null | wc -c"
    )
    assert res.stdout.split() == ["0", "0", "0"], res
    # Nothing the attacker can read under /sys or /proc/fs names the neighbour.
    res = await attacker.run_shell(
        f"grep -rls '{neighbour.id}' /sys/fs /proc/fs /proc/self/mountinfo 2>/dev/null | head"
    )
    assert res.stdout == "", res


async def test_mountinfo_names_no_host_path(
    pair: tuple[Sandbox, Sandbox, str], platform: PlatformProcess
) -> None:
    attacker, _, _ = pair
    res = await attacker.run_shell(
        "cat /proc/self/mountinfo /proc/1/mountinfo 2>/dev/null; cat /proc/mounts"
    )
    text = res.stdout
    root = next(line for line in text.splitlines() if " / / " in line)
    assert "lowerdir=/proc/self/fd/" in root and "upperdir=/proc/self/fd/" in root, root
    assert "/sandboxes/" not in root and "sha256" not in root
    # What still names the data directory: the network's resolv.conf and hosts, bound
    # from the host's disk (docs/HOST_VIEW.md, "what remains"); nothing else may.
    data_dir = str(platform.data_dir)
    rest = [line for line in text.splitlines() if data_dir in line]
    assert all(f"{data_dir}/run/net/" in line for line in rest), rest


async def test_host_identity_is_hidden(pair: tuple[Sandbox, Sandbox, str]) -> None:
    attacker, neighbour, _ = pair
    boot_id = await asyncio.to_thread(_read, "/proc/sys/kernel/random/boot_id")
    cmdline = await asyncio.to_thread(_read, "/proc/cmdline")
    for sb in (attacker, neighbour):
        res = await sb.run_shell(
            "cat /proc/cmdline /proc/sys/kernel/random/boot_id; grep -rh . /proc/sys/kernel/random/"
            " 2>/dev/null; cat /sys/devices/virtual/dmi/id/* /sys/class/dmi/id/* 2>/dev/null"
        )
        assert boot_id not in res.stdout and (not cmdline or cmdline not in res.stdout)
    out = await attacker.run_shell(
        "attack read /proc/cmdline; attack read /proc/sys/kernel/random/boot_id"
    )
    assert out.stdout.count("empty (masked)") == 2, out


async def test_memfd_secret_is_refused_and_recorded(
    client: DSecClient, pair: tuple[Sandbox, Sandbox, str]
) -> None:
    attacker, _, job = pair
    res = await attacker.exec([ATTACK_IN_SANDBOX, "memfd_secret"])
    assert res.exit_code == 0 and "denied errno=1" in res.stdout, res
    for _ in range(40):  # the listener records within a second
        evs = await client.events(job=job, kinds=[EventKind.SECCOMP_VIOLATION])
        if any(ev.detail.get("syscall") == "memfd_secret" for ev in evs):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("no seccomp_violation event for memfd_secret")


async def test_honest_tools_still_work(pair: tuple[Sandbox, Sandbox, str]) -> None:
    """What busybox's ps, top, free, uptime, df, nproc and mount read is still there."""
    attacker, _, _ = pair
    res = await attacker.run_shell(
        "set -e; ps | grep -q ps; top -bn1 | grep -q 'Load average'; free | grep -q Mem;"
        " uptime | grep -q load; df / | grep -q /; nproc; mount | grep -q ' / ';"
        " cat /proc/meminfo /proc/stat /proc/cpuinfo /proc/loadavg > /dev/null;"
        " ls /sys/devices/system/cpu | grep -q online; echo tools-ok"
    )
    assert res.exit_code == 0 and res.stdout.endswith("tools-ok\n"), res
    assert int(res.stdout.split()[0]) >= 1


async def test_python_sees_a_normal_machine(client: DSecClient) -> None:
    """debian-python: what Python reads about the machine (CPUs, affinity, load, physical
    memory, disk, platform); the image has no pip or compiler to try."""
    await client.build_image("debian-python")
    sb = await client.run_container(
        DSecContainerRunArgs(container_image="debian-python:bookworm", memory_limit_mb=512),
        timeout=120,
    )
    try:
        script = (
            "import os, platform, shutil, sysconfig, multiprocessing, resource\n"
            "assert os.cpu_count() >= 1 and multiprocessing.cpu_count() >= 1\n"
            "assert len(os.sched_getaffinity(0)) >= 1 and len(os.getloadavg()) == 3\n"
            "assert os.sysconf('SC_PHYS_PAGES') > 0 and shutil.disk_usage('/').total > 0\n"
            "assert platform.platform() and sysconfig.get_platform()\n"
            "print('python-ok')\n"
        )
        await sb.write_file("/tmp/machine.py", script.encode())
        res = await sb.run_shell("python3 /tmp/machine.py", timeout=120)
        assert res.exit_code == 0 and res.stdout.startswith("python-ok\n"), res
    finally:
        with contextlib.suppress(DSecError):
            await sb.stop()


async def test_fncall_sandbox_sees_no_host_identity(client: DSecClient, busybox_image: str) -> None:
    args = DSecFnCallRunArgs(image=busybox_image, language="sh", memory_limit_mb=64, timeout_s=10)
    res = await client.run_code(
        args,
        "wc -c < /proc/cmdline; wc -c < /proc/sys/kernel/random/boot_id; ls -A /proc/pressure"
        " | wc -l; wc -c < /proc/diskstats; cat /proc/loadavg > /dev/null && echo ok",
    )
    assert res.status == "ok", res
    assert res.stdout.split() == ["0", "0", "0", "0", "ok"], res
