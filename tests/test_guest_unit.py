"""The host-side pieces of the microVM guest that need no VM: the newc writer, module
dependencies, boot parameters and the kernel fetch's errors (tests/test_microvm_guest.py
boots the real thing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.errors import BackendError, InvalidArgument
from dsec.guest.bootparams import BASE_ARGS, BootParams
from dsec.guest.initramfs import Entry, load_order, modinfo, module_index, newc_archive
from dsec.guest.kernel import guest_kernel

needs_kernel = pytest.mark.skipif(
    shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
    reason="fetches Debian's kernel package",
)


def test_newc_archive_layout() -> None:
    blob = newc_archive([Entry("a", 0o100644, b"xyz"), Entry("dev/console", 0o20600, rdev=(5, 1))])
    assert blob.startswith(b"070701")
    assert b"TRAILER!!!\0" in blob and len(blob) % 4 == 0
    with pytest.raises(ValueError):
        newc_archive([Entry("../x", 0o100644)])


@needs_kernel
@pytest.mark.root
def test_module_dependencies_come_first() -> None:
    kernel = guest_kernel()
    index = module_index(kernel.modules)
    assert "net_failover" in modinfo(index["virtio_net"].read_bytes())["depends"].split(",")
    names = [name for _, name, _ in load_order([["virtio_console"], ["virtio_net"]], index)]
    assert names.index("virtio_ring") < names.index("virtio") < names.index("virtio_console")
    assert names.index("failover") < names.index("net_failover") < names.index("virtio_net")


def test_kernel_fetch_failure_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DSEC_GUEST_KERNEL_PACKAGE", "linux-image-0.0.0-0-cloud-amd64")
    with pytest.raises(BackendError, match=r"cannot download linux-image-0\.0\.0-0-cloud-amd64"):
        guest_kernel()
    assert [p.name for p in (tmp_path / "kernel").iterdir()] == [".lock"]  # nothing half-made
    monkeypatch.setenv("DSEC_GUEST_KERNEL_PACKAGE", "../../etc")
    with pytest.raises(BackendError, match="not a cloud kernel"):
        guest_kernel()
    shutil.rmtree(tmp_path / "kernel")


def test_boot_params_are_checked_on_the_host() -> None:
    boot = BootParams(layers=2, rw=True, ip="10.0.2.15/24", gw="10.0.2.2", hostname="guest1")
    assert boot.cmdline() == (
        f"{BASE_ARGS} dsec.layers=2 dsec.rw=1 dsec.ip=10.0.2.15/24 dsec.gw=10.0.2.2 "
        "dsec.hostname=guest1"
    )
    for bad in (
        {"layers": 0},
        {"ip": "10.0.2.15"},
        {"ip": "10.0.2.300/24"},
        {"gw": "10.0.2.2"},
        {"hostname": "a b"},
    ):
        with pytest.raises(InvalidArgument):
            BootParams(**{"layers": 1, "rw": False, **bad})  # type: ignore[arg-type]
