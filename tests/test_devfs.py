"""A container sandbox's /dev and /dev/shm: one tmpfs (issue 19, a superblock fewer).

The runtime wrapper mounts one tmpfs in its private mount namespace, fills it with the
device nodes and links crun would make, and the OCI config binds it at /dev and its
``shm`` directory at /dev/shm. Checked in real sandboxes on the session platform: one
superblock for both, /dev/shm's flags and mode as a tmpfs of its own had them, pages
charged to the sandbox's memory cgroup and capped, devices and a terminal that work,
and nothing a sandbox can do to make a device or loosen the mounts.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsec.backends.container.oci_spec import DEV_TMPFS_SIZE_KIB, SHM_HUGE
from dsec.resources import cgroups
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

MiB = 1 << 20


@pytest.fixture
def sb(roomy_sandbox: Sandbox) -> Sandbox:
    # 256 MiB: the 64 MiB tmpfs cap, not the memory limit, is what a big write meets.
    return roomy_sandbox


def _mounts(mountinfo: str) -> dict[str, list[str]]:
    """Mount point -> its mountinfo fields (the last mount at a point wins)."""
    return {line.split()[4]: line.split() for line in mountinfo.splitlines()}


def _fields(line: list[str]) -> tuple[str, str, set[str], str, set[str]]:
    """(device, root in the file system, per-mount options, fs type, super options)."""
    sep = line.index("-")
    return line[2], line[3], set(line[5].split(",")), line[sep + 1], set(line[sep + 3].split(","))


async def test_dev_and_shm_are_one_tmpfs_with_todays_flags(
    sb: Sandbox, platform: PlatformProcess
) -> None:
    info = (await sb.read_file("/proc/self/mountinfo")).decode()
    mounts = _mounts(info)
    dev_id, dev_root, dev_opts, dev_type, dev_super = _fields(mounts["/dev"])
    shm_id, shm_root, shm_opts, shm_type, _ = _fields(mounts["/dev/shm"])
    assert (dev_type, shm_type) == ("tmpfs", "tmpfs")
    assert shm_id == dev_id and (dev_root, shm_root) == ("/", "/shm"), info
    assert {"nosuid", "nodev", "noexec"} <= shm_opts, shm_opts
    assert "nosuid" in dev_opts and "nodev" not in dev_opts, dev_opts  # device nodes work
    assert f"size={DEV_TMPFS_SIZE_KIB}k" in dev_super and set(SHM_HUGE) <= dev_super
    # devpts and mqueue still mounted inside it; nothing else shares the device id
    assert _fields(mounts["/dev/pts"])[3] == "devpts"
    assert _fields(mounts["/dev/mqueue"])[3] == "mqueue"
    assert sum(_fields(f)[0] == dev_id for f in mounts.values()) == 2
    # Superblocks of its own (not the host's): overlay, proc, the /dev tmpfs, devpts,
    # mqueue (/sys is the platform's shared one); was 6 with a tmpfs for /dev/shm.
    host_info = await asyncio.to_thread(Path("/proc/self/mountinfo").read_text)
    host = {line.split()[2] for line in host_info.splitlines()}
    own = {f[2] for f in mounts.values()} - host
    assert len(own) <= 5, info
    res = await sb.run_shell("stat -c '%a %u %g' /dev/shm; touch /dev/shm/t && echo wrote")
    assert res.stdout.split("\n")[:2] == ["1777 0 0", "wrote"], res
    # The directory the wrapper mounted it on stays empty and unmounted on the host.
    dev_dir = platform.data_dir / "sandboxes" / sb.id / "dev"
    assert dev_dir.is_dir() and not await asyncio.to_thread(os.listdir, dev_dir)
    assert f" {dev_dir} " not in host_info


async def test_devices_links_and_a_terminal_work(sb: Sandbox) -> None:
    res = await sb.run_shell(
        "echo x > /dev/null && echo null-ok;"
        " head -c 5 /dev/zero | wc -c; head -c 7 /dev/urandom | wc -c;"
        " head -c 3 /dev/random | wc -c;"
        " echo x > /dev/full || echo full-refused;"
        " for l in fd stdin stdout stderr ptmx core; do echo $l=$(readlink /dev/$l); done;"
        " stat -c '%n %t:%T %a' /dev/null /dev/zero /dev/full /dev/tty /dev/random"
        " /dev/urandom"
    )
    assert res.stdout.split("\n")[:5] == ["null-ok", "5", "7", "3", "full-refused"], res
    for link in (
        "fd=/proc/self/fd",
        "stdin=/proc/self/fd/0",
        "stdout=/proc/self/fd/1",
        "stderr=/proc/self/fd/2",
        "ptmx=pts/ptmx",
        "core=/proc/kcore",
    ):
        assert link in res.stdout.split("\n"), res.stdout
    # major:minor in hex, mode as crun makes them
    for node in ("null 1:3", "zero 1:5", "full 1:7", "tty 5:0", "random 1:8", "urandom 1:9"):
        assert f"/dev/{node} 666" in res.stdout, res.stdout
    # A terminal (the SDK's pty: /dev/ptmx through the newinstance devpts) in which
    # /dev/tty is the controlling terminal.
    async with await sb.pty(command="tty; echo via-$((6*7)) > /dev/tty") as term:
        out = b""
        while data := await term.read():
            out += data
    assert b"/dev/pts/" in out and b"via-42" in out, out
    assert term.exit is not None and term.exit.exit_code == 0, term.exit


def _shmem(edge_id: str, sandbox_id: str) -> int:
    stat = cgroups.detect().v1["memory"] / "dsec" / edge_id / sandbox_id / "memory.stat"
    fields = dict(line.split() for line in stat.read_text().splitlines())
    return int(fields["total_shmem"])


@pytest.mark.skipif("memory" not in cgroups.detect().v1, reason="v1 memory controller")
async def test_shm_pages_are_the_sandboxes_and_capped(
    sb: Sandbox, platform: PlatformProcess
) -> None:
    res = await sb.run_shell("dd if=/dev/zero of=/dev/shm/a bs=1M count=32 2>&1")
    assert res.exit_code == 0, res
    assert _shmem(platform.edge_id, sb.id) >= 32 * MiB
    # 100 MiB stops at the cap (ENOSPC), well inside the 256 MiB memory limit.
    res = await sb.run_shell(
        "rm /dev/shm/a; dd if=/dev/zero of=/dev/shm/b bs=1M count=100 2>&1; echo rc=$?;"
        " wc -c < /dev/shm/b"
    )
    assert "No space left" in res.stdout and "rc=0" not in res.stdout, res
    assert int(res.stdout.split()[-1]) <= DEV_TMPFS_SIZE_KIB * 1024, res
    # The cap is shared: what /dev holds leaves that much less for /dev/shm.
    res = await sb.run_shell(
        "rm /dev/shm/b; dd if=/dev/zero of=/dev/big bs=1M count=40 2>/dev/null;"
        " dd if=/dev/zero of=/dev/shm/c bs=1M count=40 2>/dev/null || echo shared-cap;"
        " rm -f /dev/big /dev/shm/c"
    )
    assert "shared-cap" in res.stdout, res
    # Memory limit unchanged by it: the sandbox was not killed.
    assert (await sb.run_shell("echo alive")).stdout == "alive\n"


async def test_no_usable_device_and_no_remount(sb: Sandbox) -> None:
    res = await sb.run_shell(
        "mknod /dev/sda b 8 0 2>/dev/null && echo made-block;"
        " mknod /dev/shm/mem c 1 1 2>/dev/null && echo made-char;"
        " head -c 1 /dev/sda 2>/dev/null && echo read-block;"
        " mount -o remount,dev,exec,suid /dev/shm 2>/dev/null && echo remounted-shm;"
        " mount -o remount,size=1g /dev 2>/dev/null && echo remounted-dev;"
        " umount /dev/shm 2>/dev/null && echo unmounted;"
        " mount -t tmpfs none /dev/shm 2>/dev/null && echo new-tmpfs;"
        " cp /bin/busybox /dev/shm/bb && /dev/shm/bb true 2>/dev/null && echo exec-shm;"
        " rm -f /dev/shm/bb; grep ' /dev/shm ' /proc/self/mountinfo"
    )
    assert res.stdout.count("\n") == 1, res  # only the mountinfo line: every try failed
    assert {"nosuid", "nodev", "noexec"} <= set(res.stdout.split()[5].split(","))
