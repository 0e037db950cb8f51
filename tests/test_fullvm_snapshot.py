"""Snapshots of full VMs as VM images (``sb.snapshot``), end to end: a real `dsec up`,
the project's small VM image, one VM booted under TCG for the module and shared.

What is shown: a guest with a background counter (a shell loop), a value in RAM only
(/tmp, a tmpfs) and a file on its disk is saved as a VM image with the VM frozen
across both the state and the disk; a new sandbox started from that image does not
boot (its uptime goes on from the source's) and finds the counter's process still
running and counting, the RAM value and the disk file; the source runs on unaware and
independent of it (what each writes afterwards the other never sees); the captured
disk is a standalone, read-only blob of the image store (no backing file), not a file
either VM can write; a snapshot of a snapshot, a job pause/resume and an edge SIGKILL of
a VM from a snapshot, a VM frozen by an edge that died mid-snapshot continued after
the restart, a UEFI VM's snapshot (restored under UEFI only); a bad name is a 422, an
existing one a 409 (never replaced), a container a 501 naming the capability; the CLI
saves one too; every QEMU, directory and cgroup is gone at the end (and
tests/conftest.py leak-checks the platform).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecSyncClient
from dsec.api.spec import DSecContainerRunArgs, DSecFullVMRunArgs
from dsec.errors import (
    AlreadyExists,
    DSecError,
    FileNotFound,
    InvalidArgument,
    LimitExceeded,
    Unsupported,
)
from dsec.guest.vmimage import busybox_vm_image
from dsec.sdk.sync import SyncSandbox
from tests.conftest import PlatformProcess, platform_process, qemus
from tests.fullvm_env import BOOT, FULLVM_MARKS

pytestmark = FULLVM_MARKS

IMAGE = "fvm-snap-base:1"
SNAP = "fvm-snap:1"
COUNTER = (
    "(i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done)"
    " >/dev/null 2>&1 & echo $! > /tmp/pid"
)


@dataclass
class Snap:
    plat: PlatformProcess
    client: DSecSyncClient
    sb: SyncSandbox


@pytest.fixture(scope="module")
def snap() -> Iterator[Snap]:
    files = busybox_vm_image()  # cached under $DSEC_CACHE_DIR after the first build
    with (
        platform_process(DSEC_BACKENDS="fullvm,container") as plat,
        DSecSyncClient(plat.url, plat.api_key) as client,
    ):
        client.import_vm(
            IMAGE, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
        )
        spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256, disk_limit_mb=256)
        sb = client.run_fullvm(spec, timeout=BOOT)
        try:
            yield Snap(plat, client, sb)
        finally:
            with contextlib.suppress(DSecError):
                sb.stop()


def _count(sb: SyncSandbox) -> int:
    return int(sb.read_text("/tmp/count").strip() or "0")


def _uptime(sb: SyncSandbox) -> float:
    return float(sb.read_text("/proc/uptime").split()[0])


def _counting(sb: SyncSandbox) -> None:
    """The counter's process runs (same pid) and its count goes up."""
    pid = sb.read_text("/tmp/pid").strip()
    assert sb.run_shell(f"kill -0 {pid}").exit_code == 0, "the counter is gone"
    first = _count(sb)
    deadline = time.monotonic() + 30
    while _count(sb) <= first:
        assert time.monotonic() < deadline, "the counter stopped counting"
        time.sleep(0.5)


def test_a_snapshot_restores_processes_ram_and_disk_without_booting(snap: Snap) -> None:
    src = snap.sb
    assert src.run_shell(COUNTER).exit_code == 0
    src.write_file("/tmp/ram-only", "in-ram")
    src.write_file("/root/on-disk", "on-disk")
    _counting(src)
    up_before = _uptime(src)
    t0 = time.monotonic()
    image = src.snapshot(SNAP)
    print(f"fullvm snapshot: {time.monotonic() - t0:.1f}s")
    vm = image.config["vm"]
    assert isinstance(vm, dict) and vm["state"] in image.layers
    assert vm["machine"]["memory_mb"] == 256 and vm["format"] == "qcow2"
    # the source runs on, its counter too
    assert src.refresh().state.value == "running"
    _counting(src)
    # the captured disk: a standalone, read-only blob of the store, no VM's file
    digest = vm["disk"].split(":")[-1]
    blob = next(snap.plat.data_dir.rglob(f"blobs/sha256/{digest}"))
    assert blob.stat().st_mode & 0o222 == 0
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "-U", "--output=json", str(blob)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert "backing-filename" not in info and info["virtual-size"] == 256 << 20
    assert "fullvms" not in str(blob)

    t0 = time.monotonic()
    spec = DSecFullVMRunArgs(vm_image=SNAP, memory_limit_mb=256)
    with snap.client.run_fullvm(spec, timeout=BOOT) as clone:
        print(f"fullvm start from snapshot: {time.monotonic() - t0:.1f}s")
        assert _uptime(clone) >= up_before  # restored, not booted
        assert clone.read_text("/tmp/ram-only") == "in-ram"
        assert clone.read_text("/root/on-disk") == "on-disk"
        _counting(clone)
        # two independent VMs: what one writes after the snapshot the other never sees
        src.write_file("/root/after", "src")
        clone.write_file("/tmp/clone-only", "clone")
        with pytest.raises(FileNotFound):
            clone.read_text("/root/after")
        with pytest.raises(FileNotFound):
            src.read_text("/tmp/clone-only")
        assert len(qemus(snap.plat.data_dir)) == 2
        clone_dir = snap.plat.data_dir / "fullvms" / clone.id
        assert clone_dir.is_dir()
        # a snapshot of a VM started from a snapshot: its processes go on again
        clone.snapshot("fvm-snap-of-snap:1")
        spec2 = DSecFullVMRunArgs(vm_image="fvm-snap-of-snap:1", memory_limit_mb=256)
        with snap.client.run_fullvm(spec2, timeout=BOOT) as grandchild:
            assert grandchild.read_text("/tmp/clone-only") == "clone"
            _counting(grandchild)
    assert not clone_dir.exists()
    assert len(qemus(snap.plat.data_dir)) == 1
    _counting(src)


def test_a_vm_from_a_snapshot_pauses_and_resumes_and_survives_an_edge_crash(
    snap: Snap,
) -> None:
    """Its saved launch is the snapshot's machine (-incoming again on resume)."""
    spec = DSecFullVMRunArgs(vm_image=SNAP, memory_limit_mb=256, job_id="fvm-snap-job")
    with snap.client.run_fullvm(spec, timeout=BOOT) as clone:
        _counting(clone)
        assert snap.client.pause_job("fvm-snap-job").paused == 1
        assert clone.refresh().state.value == "paused"
        assert clone.read_text("/tmp/ram-only") == "in-ram"  # a request resumes it
        _counting(clone)
        snap.plat.kill()  # SIGKILL: the restarted edge re-adopts both VMs
        snap.plat.start()
        _counting(clone)
        _counting(snap.sb)


def _qmp(sock_path: Path, *commands: str) -> list[dict[str, object]]:
    """A few QMP commands on a VM's socket (free while its edge is dead)."""
    answers: list[dict[str, object]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(sock_path))
        reader = sock.makefile("rb")
        reader.readline()  # the greeting
        for cmd in ("qmp_capabilities", *commands):
            sock.sendall(json.dumps({"execute": cmd}).encode() + b"\n")
            while True:
                msg = json.loads(reader.readline())
                if "return" in msg or "error" in msg:
                    answers.append(msg)
                    break
    return answers


def test_a_vm_frozen_by_an_edge_that_died_mid_snapshot_runs_on_after_restart(
    snap: Snap,
) -> None:
    snap.plat.kill()  # SIGKILL as if between the capture's stop and its cont
    sock = snap.plat.data_dir / "fullvms" / snap.sb.id / "q" / "qmp.sock"
    status = _qmp(sock, "stop", "query-status")[-1]["return"]
    assert isinstance(status, dict) and status["status"] == "paused"
    snap.plat.start()
    assert snap.sb.refresh().state.value == "running"
    _counting(snap.sb)


@pytest.mark.skipif(not Path("/usr/share/OVMF/OVMF_CODE_4M.fd").is_file(), reason="no ovmf")
def test_a_uefi_vm_snapshot_restores_under_uefi(snap: Snap) -> None:
    spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256, firmware="uefi")
    with snap.client.run_fullvm(spec, timeout=BOOT) as src:
        src.write_file("/tmp/uefi-ram", "uefi")
        image = src.snapshot("fvm-snap-uefi:1")
        assert image.config["vm"]["machine"]["firmware"] == "uefi"  # type: ignore[index]
        with pytest.raises(InvalidArgument, match="firmware"):
            snap.client.run_fullvm(
                DSecFullVMRunArgs(vm_image="fvm-snap-uefi:1", memory_limit_mb=256)
            )
        again = DSecFullVMRunArgs(vm_image="fvm-snap-uefi:1", memory_limit_mb=256, firmware="uefi")
        with snap.client.run_fullvm(again, timeout=BOOT) as clone:
            assert clone.read_text("/tmp/uefi-ram") == "uefi"
            assert clone.run_shell("test -d /sys/firmware/efi && echo efi").stdout == "efi\n"


def test_snapshot_names_are_checked_and_never_replaced(snap: Snap) -> None:
    with pytest.raises(InvalidArgument):
        snap.sb.snapshot("Bad Name!")
    target = "fvm-snap-dup:1"
    before = snap.sb.snapshot(target).layers
    with pytest.raises(AlreadyExists):
        snap.sb.snapshot(target)
    with pytest.raises(AlreadyExists):
        snap.sb.snapshot(IMAGE)  # an imported image is never replaced either
    assert snap.client.get_image(target).layers == before
    assert snap.sb.refresh().state.value == "running"
    # a restore must fit its saved RAM
    with pytest.raises(LimitExceeded):
        snap.client.run_fullvm(DSecFullVMRunArgs(vm_image=target, memory_limit_mb=128))
    # the saved machine has no NIC: a sandbox from it cannot have network rules
    ruled = DSecFullVMRunArgs(
        vm_image=target, memory_limit_mb=256, network_rules={"198.18.0.1:80": True}
    )
    with pytest.raises(Unsupported) as err:
        snap.client.run_fullvm(ruled, timeout=BOOT)
    assert err.value.details.get("capability") == "snapshot_network_rules"
    assert [p.name for p in (snap.plat.data_dir / "fullvms").iterdir()] == [snap.sb.id]


def test_snapshot_of_a_container_is_a_501(snap: Snap) -> None:
    snap.client.build_image("busybox")
    with snap.client.run_container(DSecContainerRunArgs(container_image="busybox")) as box:
        with pytest.raises(Unsupported) as err:
            box.snapshot("box-snap:1")
        assert err.value.details.get("capability") == "snapshot"
    with pytest.raises(DSecError):
        snap.client.get_image("box-snap:1")


def test_cli_saves_a_snapshot(snap: Snap) -> None:
    env = {**os.environ, "DSEC_URL": snap.plat.url, "DSEC_API_KEY": snap.plat.api_key}
    argv = [sys.executable, "-m", "dsec.cli.main", "sandbox", "snapshot", snap.sb.id]
    done = subprocess.run(
        [*argv, "fvm-snap-cli:1", "--json"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["name"] == "fvm-snap-cli" and "state" in info["config"]["vm"]
    again = subprocess.run([*argv, "fvm-snap-cli:1"], env=env, capture_output=True, text=True)
    assert again.returncode != 0 and "exists" in again.stderr


def test_stop_leaves_nothing_behind(snap: Snap) -> None:
    vm_dir = snap.plat.data_dir / "fullvms" / snap.sb.id
    assert vm_dir.is_dir()
    snap.sb.stop()
    assert qemus(snap.plat.data_dir) == []
    assert not vm_dir.exists()
    tmp = [p for p in snap.plat.data_dir.rglob("tmp/*") if p.is_file()]
    assert tmp == [], tmp  # no partial state or disk file left in the store
