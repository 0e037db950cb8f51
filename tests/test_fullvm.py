"""The fullvm backend end to end: a real `dsec up` (fullvm and container), the project's
small VM image (dsec.guest.vmimage: Debian's cloud kernel, busybox, Debian's qemu-ga)
imported with ``import_vm``, one q35 VM under TCG booted for the module and shared,
driven through the SDK as a user would, and looked at from the host.

What is shown: commands and files through the standard QEMU guest agent, the disk
limit as the overlay's size, screenshots and typed keys through QMP (the keys reach
the guest's shell on its VGA console), a second VM under UEFI (OVMF) whose framebuffer
has the display size asked for, 501s for what the backend does not declare (sessions)
and for computer use on a container, a guest that garbles its agent
port without breaking the edge, an edge SIGKILLed and restarted re-adopting the running
VM, a job pause saving the VM to a file (kept across an edge crash) and a request
restoring it, a guest that powers off failing its sandbox with that reason, and a stop that
leaves no QEMU, overlay or cgroup (the module's platform is leak-checked too:
tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecSyncClient
from dsec.api.spec import DSecContainerRunArgs, DSecFullVMRunArgs
from dsec.errors import DSecError, FileNotFound, InvalidArgument, LimitExceeded, Unsupported
from dsec.guest.vmimage import busybox_vm_image
from dsec.resources import cgroups, oom, qos
from dsec.sdk.sync import SyncSandbox
from tests.conftest import PlatformProcess, platform_process, qemus
from tests.fullvm_env import BOOT, FULLVM_MARKS
from tests.test_qos import cpu_class

pytestmark = FULLVM_MARKS

IMAGE = "fvm-test:1"
JOB = "fvm-test-job"
PNG = b"\x89PNG\r\n\x1a\n"


@dataclass
class FVM:
    plat: PlatformProcess
    client: DSecSyncClient
    sb: SyncSandbox

    @property
    def dir(self) -> Path:
        return self.plat.data_dir / "fullvms" / self.sb.id

    @property
    def cgroup(self) -> str:
        return f"/dsec/{self.plat.edge_id}-fvm/{self.sb.id}"


@pytest.fixture(scope="module")
def fvm() -> Iterator[FVM]:
    files = busybox_vm_image()  # cached under $DSEC_CACHE_DIR after the first build
    with (
        platform_process(DSEC_BACKENDS="fullvm,container") as plat,
        DSecSyncClient(plat.url, plat.api_key) as client,
    ):
        image = client.import_vm(
            IMAGE, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
        )
        assert image.config["vm"]["format"] == "raw"  # type: ignore[index]
        spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256, disk_limit_mb=256, job_id=JOB)
        t0 = time.monotonic()
        sb = client.run_fullvm(spec, timeout=BOOT)
        print(f"fullvm boot to guest agent: {time.monotonic() - t0:.1f}s ({sb.info.accelerator})")
        try:
            yield FVM(plat, client, sb)
        finally:
            with contextlib.suppress(DSecError):
                sb.stop()


def test_commands_run_through_the_guest_agent(fvm: FVM) -> None:
    assert fvm.sb.info.accelerator in ("tcg", "kvm")
    res = fvm.sb.run_shell("echo hi; echo err >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr) == (3, "hi\n", "err\n")
    assert fvm.sb.exec(["cat", "/proc/sys/kernel/hostname"]).stdout == "dsec-fullvm\n"
    assert fvm.sb.run_shell("pwd", workdir="/tmp").stdout == "/tmp\n"
    assert fvm.sb.run_shell("cat", stdin="from stdin").stdout == "from stdin"
    assert fvm.sb.exec(["/no/such/program"]).exit_code == 127
    # the disk limit is the overlay's virtual size: the guest sees a 256 MiB disk
    assert fvm.sb.run_shell("cat /sys/block/vda/size").stdout.strip() == str(256 * 2048)


def test_files_through_the_guest_agent(fvm: FVM) -> None:
    data = bytes(range(256)) * 5000  # 1.28 MB of binary: two guest-file-* chunks
    fvm.sb.write_file("/root/blob.bin", data, mode=0o600)
    assert fvm.sb.read_file("/root/blob.bin") == data
    assert fvm.sb.run_shell("stat -c %a /root/blob.bin").stdout.strip() == "600"
    fvm.sb.write_file("/root/t.txt", "text")
    assert fvm.sb.read_text("/root/t.txt") == "text"
    with pytest.raises(FileNotFound):
        fvm.sb.read_file("/root/absent")
    # the writes landed in the sandbox's private overlay, not in the shared image
    assert fvm.sb.run_shell("sync").exit_code == 0
    assert (fvm.dir / "disk.qcow2").stat().st_blocks * 512 > len(data)


def test_screenshot_is_a_png_of_the_screen(fvm: FVM) -> None:
    png = fvm.sb.screenshot()
    assert png.startswith(PNG)
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (720, 400)  # the VGA text console of this image
    with pytest.raises(InvalidArgument, match="outside the 720x400 screen"):
        fvm.sb.mouse_move(720, 10)


def test_typed_keys_reach_the_guest_and_change_the_screen(fvm: FVM) -> None:
    before = fvm.sb.screenshot()
    fvm.sb.write("touch /tmp/typed-by-qmp")
    deadline = time.monotonic() + 30
    while fvm.sb.screenshot() == before:  # the shell on tty1 echoes the keys
        assert time.monotonic() < deadline, "the screen did not change"
        time.sleep(0.2)
    fvm.sb.press("enter")
    while fvm.sb.run_shell("test -e /tmp/typed-by-qmp").exit_code != 0:
        assert time.monotonic() < deadline, "the typed command did not run"
        time.sleep(0.2)
    fvm.sb.press(["ctrl", "l"])  # a chord
    fvm.sb.mouse_move(100, 100)
    fvm.sb.left_click()
    fvm.sb.right_click(10, 10)
    fvm.sb.double_click()
    fvm.sb.scroll("down", 3)
    with pytest.raises(InvalidArgument):
        fvm.sb.write("non-ascii: é")


def test_what_the_backend_lacks_is_a_501_naming_it(fvm: FVM) -> None:
    with pytest.raises(Unsupported) as err:
        fvm.sb.start("sleep 1")
    assert err.value.details.get("capability") == "sessions"
    assert err.value.details.get("backend") == "fullvm"


@pytest.mark.skipif(not Path("/usr/share/OVMF/OVMF_CODE_4M.fd").is_file(), reason="no ovmf")
def test_uefi_boots_with_a_framebuffer_of_the_display_size(fvm: FVM) -> None:
    spec = DSecFullVMRunArgs(
        vm_image=IMAGE, firmware="uefi", display=(1024, 768), memory_limit_mb=256
    )
    t0 = time.monotonic()
    with fvm.client.run_fullvm(spec, timeout=BOOT) as sb:
        print(f"UEFI boot to guest agent: {time.monotonic() - t0:.1f}s")
        assert sb.run_shell("test -d /sys/firmware/efi && echo efi").stdout == "efi\n"
        png = sb.screenshot()  # OVMF's framebuffer, taken over by the kernel's fbcon
        size = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert png.startswith(PNG) and size == (1024, 768)
        vm_dir = fvm.plat.data_dir / "fullvms" / sb.id
        assert (vm_dir / "efivars.fd").is_file()  # its own variable store
    assert not vm_dir.exists()


def test_computer_use_on_a_container_is_a_501(fvm: FVM) -> None:
    fvm.client.build_image("busybox")
    with fvm.client.run_container(DSecContainerRunArgs(container_image="busybox")) as box:
        with pytest.raises(Unsupported) as err:
            box.screenshot()
        assert err.value.details.get("capability") == "computer_use"
        with pytest.raises(Unsupported):
            box.left_click()


def test_vm_images_are_checked(fvm: FVM, tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * 65536)
    sneaky = tmp_path / "sneaky.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(sneaky)],
        check=True,
    )
    with pytest.raises(InvalidArgument, match="backing file"):
        fvm.client.import_vm("sneaky:1", sneaky)
    fvm.client.build_image("busybox")  # a layered image (cached once built)
    with pytest.raises(InvalidArgument, match="not a VM image"):
        fvm.client.run_fullvm(DSecFullVMRunArgs(vm_image="busybox:latest"), timeout=30)
    with pytest.raises(LimitExceeded, match="smaller than the VM image"):
        fvm.client.run_fullvm(DSecFullVMRunArgs(vm_image=IMAGE, disk_limit_mb=64), timeout=60)
    assert [p.name for p in (fvm.plat.data_dir / "fullvms").iterdir()] == [fvm.sb.id]


def test_a_qcow2_image_boots_too(fvm: FVM, tmp_path: Path) -> None:
    files = busybox_vm_image()
    disk = tmp_path / "disk.qcow2"
    subprocess.run(
        ["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(files.disk), str(disk)],
        check=True,
    )
    image = fvm.client.import_vm(
        "fvm-qcow2:1", disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
    )
    assert image.config["vm"]["format"] == "qcow2"  # type: ignore[index]
    spec = DSecFullVMRunArgs(vm_image="fvm-qcow2:1", memory_limit_mb=256)
    with fvm.client.run_fullvm(spec, timeout=BOOT) as sb:
        assert sb.run_shell("echo from-qcow2").stdout == "from-qcow2\n"


def test_cli_imports_a_vm_image(fvm: FVM) -> None:
    files = busybox_vm_image()
    env = {**os.environ, "DSEC_URL": fvm.plat.url, "DSEC_API_KEY": fvm.plat.api_key}
    argv = [sys.executable, "-m", "dsec.cli.main", "image", "import-vm", "fvm-cli:1"]
    argv += [str(files.disk), "--kernel", str(files.kernel), "--initrd", str(files.initrd)]
    done = subprocess.run(
        [*argv, "--append", files.cmdline, "--json"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["name"] == "fvm-cli" and len(info["layers"]) == 3
    assert info["layers"] == fvm.client.get_image(IMAGE).layers  # same bytes, same blobs


def test_a_guest_that_garbles_its_agent_port_does_not_break_the_edge(fvm: FVM) -> None:
    # The guest kills its agent and writes junk (no newline, then binary) to the port;
    # its init starts the agent again a second later.
    fvm.sb.run_shell(
        "port=$(grep -l org.qemu.guest_agent.0 /sys/class/virtio-ports/*/name); "
        "port=/dev/$(basename $(dirname $port)); "
        "(sleep 0.5; kill -9 $(cat /run/qemu-ga.pid); "
        "head -c 200000 /dev/urandom > $port; printf '{{{garbage' > $port) "
        ">/dev/null 2>&1 &"
    )
    time.sleep(1.5)
    deadline = time.monotonic() + 60
    while True:
        try:
            if fvm.sb.run_shell("echo back").stdout == "back\n":
                break
        except DSecError:
            pass  # a garbled answer fails the call it answered: typed, never a hang
        assert time.monotonic() < deadline, "the guest agent never answered again"
        time.sleep(0.5)
    assert fvm.sb.refresh().state.value == "running"


def test_an_edge_killed_with_sigkill_re_adopts_the_running_vm(fvm: FVM) -> None:
    fvm.sb.write_file("/root/before-crash", "kept")
    before = qemus(fvm.plat.data_dir)
    fvm.plat.kill()  # SIGKILL: the platform gets no chance to clean up
    assert qemus(fvm.plat.data_dir) == before  # the VM runs on without its edge
    fvm.plat.start()
    assert fvm.sb.refresh().state.value == "running"
    assert fvm.sb.read_text("/root/before-crash") == "kept"  # guest agent linked again
    assert fvm.sb.run_shell("echo again").stdout == "again\n"
    assert fvm.sb.screenshot().startswith(PNG)  # QMP linked again
    assert qemus(fvm.plat.data_dir) == before  # the same QEMU, adopted


def test_a_job_pause_saves_the_vm_to_a_file_and_a_request_resumes_it(fvm: FVM) -> None:
    fvm.sb.run_shell("echo in-ram > /tmp/marker")  # tmpfs: only the saved memory has it
    before = qemus(fvm.plat.data_dir)
    report = fvm.client.pause_job(JOB)
    assert report.paused == 1, report
    assert fvm.sb.refresh().state.value == "paused"
    assert qemus(fvm.plat.data_dir) == []  # QEMU ended: its memory is the host's again
    assert (fvm.dir / "state.snap").is_file()
    # Paused across an edge crash: still paused after the restart (adopt_paused) ...
    fvm.plat.kill()
    fvm.plat.start()
    assert fvm.sb.refresh().state.value == "paused"
    # ... and any request resumes it, transparently: a new QEMU restores the file.
    assert fvm.sb.read_text("/tmp/marker") == "in-ram\n"
    assert fvm.sb.refresh().state.value == "running"
    after = qemus(fvm.plat.data_dir)
    assert len(after) == 1 and after != before
    assert not (fvm.dir / "state.snap").exists()
    assert fvm.sb.screenshot().startswith(PNG)


def test_a_best_effort_vm_runs_idle_also_after_its_restore(fvm: FVM) -> None:
    """QoS classes hold for full VMs as for microVMs: a best-effort VM's QEMU, every
    thread of it (vCPUs included), runs at SCHED_IDLE in a cgroup of the lowest weight,
    and so does the new QEMU that restores it after a job pause; both carry the
    class's OOM bias (dsec.resources.oom)."""
    job = "fvm-qos-job"
    spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256, qos="best_effort", job_id=job)
    sb = fvm.client.run_fullvm(spec, timeout=BOOT)
    try:
        cgroup = f"/dsec/{fvm.plat.edge_id}-fvm/{sb.id}"
        vm_dir = fvm.plat.data_dir / "fullvms" / sb.id

        def check() -> None:
            pids = qemus(vm_dir)
            assert len(pids) == 1, pids
            tids = qos.threads_of(pids[0])
            assert len(tids) > 1  # QEMU's vCPU and I/O threads
            assert {qos.policy_of(t) for t in tids} == {os.SCHED_IDLE}
            assert cpu_class(cgroup) == "best_effort"
            assert oom.oom_score_adj_of(pids[0]) == oom.oom_score_adj("best_effort")

        assert sb.run_shell("true").exit_code == 0
        check()
        assert fvm.client.pause_job(job).paused == 1
        assert qemus(vm_dir) == []
        assert sb.run_shell("true").exit_code == 0  # a new QEMU restores its file
        check()
        latency = fvm.client.health().backend_details["fullvm"]["core_scheduling"]
        assert latency == qos.health_detail()["core_scheduling"]  # detected, not assumed
    finally:
        sb.stop()


def test_a_guest_that_powers_off_fails_its_sandbox_with_the_reason(fvm: FVM) -> None:
    spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256)
    sb = fvm.client.run_fullvm(spec, timeout=BOOT)
    sb.run_shell("(sleep 0.5; poweroff -f) >/dev/null 2>&1 &")
    deadline = time.monotonic() + 60
    while not sb.refresh().state.terminal:
        assert time.monotonic() < deadline, "the sandbox outlived its guest"
        time.sleep(0.3)
    assert sb.state.value == "failed"
    assert "shut down" in (sb.info.reason or ""), sb.info.reason
    assert not (fvm.plat.data_dir / "fullvms" / sb.id).exists()


def test_stop_leaves_nothing_behind(fvm: FVM) -> None:
    assert fvm.dir.is_dir() and any(qemus(fvm.plat.data_dir))
    host = cgroups.detect()
    assert any(d.is_dir() for d in host.dirs(fvm.cgroup))
    fvm.sb.stop()
    assert qemus(fvm.plat.data_dir) == []
    assert not fvm.dir.exists()
    assert not any(d.is_dir() for d in host.dirs(fvm.cgroup))
    fvm.sb.stop()  # idempotent
