"""dsec.backends.fullvm.capture without a VM: a fake QMP peer and real qemu-img.

What is shown: the captured disk is the overlay chain flattened into one standalone
qcow2 (no backing file, the same guest-visible bytes, read-only), with the backing
file taken from the command line even when the overlay's header names another; the
VM is stopped before and continued after, in that order; a failing migration or a
failing copy continues the VM, cancels the migration and leaves no file behind; with
root, qemu-img runs jailed as the VM's QEMU's uid (it cannot read what that uid cannot)
and the copy is handed back to root, read-only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from dsec.backends.fullvm import capture
from dsec.backends.microvm.jail import UID_BASE, Jail
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.errors import BackendError

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None or shutil.which("qemu-io") is None,
    reason="no qemu-img/qemu-io (scripts/install.sh installs qemu-utils)",
)

MiB = 1 << 20


class FakeQmp:
    """Answers what capture asks; ``fail`` names a command that raises."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[str] = []

    async def execute(
        self, cmd: str, arguments: Mapping[str, object] | None = None, timeout: float = 5
    ) -> dict[str, Any]:
        self.calls.append(cmd)
        if cmd == self.fail:
            raise QmpError(f"{cmd} failed")
        if cmd == "query-migrate":
            return {"status": "completed"}
        return {}

    async def send_fd(self, name: str, fd: int, timeout: float = 5) -> None:
        self.calls.append("getfd")


def _img(*argv: str) -> str:
    return subprocess.run(["qemu-img", *argv], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path]:
    """A raw base of "B"s and a qcow2 overlay over it that wrote "O"s at 1 MiB (as a
    guest would), 4 MiB of virtual disk."""
    base = tmp_path / "base.raw"
    base.write_bytes(b"B" * 2 * MiB)
    overlay = tmp_path / "overlay.qcow2"
    _img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(overlay), "4M")
    subprocess.run(
        ["qemu-io", "-f", "qcow2", "-c", "write -P 0x4f 1M 1M", str(overlay)],
        check=True,
        capture_output=True,
    )
    return base, overlay


EXPECTED = b"B" * MiB + b"O" * MiB + b"\0" * 2 * MiB


def _run(
    qmp: FakeQmp, overlay: Path, base: Path, tmp: Path, jail: Jail | None = None
) -> capture.Captured:
    return asyncio.run(
        capture.capture(
            cast(Qmp, qmp),
            overlay=overlay,
            base=base,
            base_format="raw",
            state_out=tmp / "state",
            disk_out=tmp / "disk.qcow2",
            jail=jail,
        )
    )


def test_the_disk_is_flattened_standalone_and_the_vm_continues(
    chain: tuple[Path, Path], tmp_path: Path
) -> None:
    base, overlay = chain
    qmp = FakeQmp()
    done = _run(qmp, overlay, base, tmp_path)
    assert qmp.calls.index("stop") < qmp.calls.index("migrate") < qmp.calls.index("cont")
    assert "migrate_cancel" not in qmp.calls
    out = tmp_path / "disk.qcow2"
    info = json.loads(_img("info", "--output=json", str(out)))
    assert "backing-filename" not in info and info["virtual-size"] == 4 * MiB
    assert out.stat().st_mode & 0o222 == 0
    flat = tmp_path / "flat.raw"
    _img("convert", "-q", "-O", "raw", str(out), str(flat))
    assert flat.read_bytes() == EXPECTED
    assert done.disk_bytes == out.stat().st_size


def test_the_backing_file_comes_from_the_command_line(
    chain: tuple[Path, Path], tmp_path: Path
) -> None:
    base, overlay = chain
    decoy = tmp_path / "decoy.raw"
    decoy.write_bytes(b"S" * 2 * MiB)
    # the jailed QEMU could rewrite its overlay's header to name any host file
    _img("rebase", "-u", "-q", "-f", "qcow2", "-F", "raw", "-b", str(decoy), str(overlay))
    _run(FakeQmp(), overlay, base, tmp_path)
    flat = tmp_path / "flat.raw"
    _img("convert", "-q", "-O", "raw", str(tmp_path / "disk.qcow2"), str(flat))
    assert flat.read_bytes() == EXPECTED  # not the decoy's bytes


@pytest.mark.parametrize("failing", ["migrate", "copy"])
def test_a_failure_continues_the_vm_and_leaves_nothing(
    chain: tuple[Path, Path], tmp_path: Path, failing: str
) -> None:
    base, overlay = chain
    qmp = FakeQmp(fail="migrate" if failing == "migrate" else None)
    missing = tmp_path / "gone.raw"  # the copy cannot open its backing file
    with pytest.raises(BackendError):
        _run(qmp, overlay, base if failing == "migrate" else missing, tmp_path)
    assert qmp.calls[-2:] == ["migrate_cancel", "cont"]
    assert not (tmp_path / "state").exists()
    assert not (tmp_path / "disk.qcow2").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")
def test_the_copy_runs_jailed_as_the_vms_uid(chain: tuple[Path, Path], tmp_path: Path) -> None:
    base, overlay = chain
    uid = UID_BASE + (1 << 22) + 1  # above pid_max: no live QEMU's uid
    os.chown(overlay, uid, uid)  # as the backend leaves a VM's overlay
    overlay.chmod(0o600)
    jail = Jail(as_uid=uid)
    base.chmod(0o600)  # root's alone: the jailed copy cannot read it, as QEMU could not
    qmp = FakeQmp()
    with pytest.raises(BackendError):
        _run(qmp, overlay, base, tmp_path, jail)
    assert qmp.calls[-2:] == ["migrate_cancel", "cont"]
    assert not (tmp_path / "disk.qcow2").exists() and not (tmp_path / "state").exists()
    base.chmod(0o644)
    _run(FakeQmp(), overlay, base, tmp_path, jail)
    out = tmp_path / "disk.qcow2"
    st = out.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o444)
    flat = tmp_path / "flat.raw"
    _img("convert", "-q", "-O", "raw", str(out), str(flat))
    assert flat.read_bytes() == EXPECTED
