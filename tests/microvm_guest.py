"""A throwaway guest for the VMM tests: Debian's cloud kernel plus a busybox initramfs.

The VMM layer (``dsec.backends.microvm``) must be testable without the real guest
(``dsec.guest``), so this builds the smallest guest that exercises what the VMM cares
about: it boots under TCG on ``-M microvm``, loads the virtio-mmio and virtio-serial
modules, and runs a shell script as pid 1. The kernel is fetched with ``apt-get
download`` once and unpacked under the cache dir; the lead later swaps this for
``dsec.guest.kernel.guest_kernel()``.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsec.native import cache_dir

KERNEL_META = "linux-image-cloud-amd64"
# Load order matters: each module's dependencies come first. The late ones are
# loaded by the script's `late` call: after the GO of a template restore, as in the
# real guest, so a restored VM probes the drives and NIC it was restored with.
EARLY_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
LATE_MODULES = ("virtio_blk", "failover", "net_failover", "virtio_net")
MODULES = EARLY_MODULES + LATE_MODULES


@dataclass(frozen=True)
class GuestKernel:
    vmlinuz: Path
    modules: dict[str, Path]  # module name -> .ko
    release: str


def _versioned_package() -> str:
    out = subprocess.run(
        ["apt-cache", "depends", KERNEL_META], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"Depends: (linux-image-[0-9][^\s]*)", out)
    if match is None:
        raise RuntimeError(f"apt-cache depends {KERNEL_META}: no versioned kernel in {out!r}")
    return match.group(1)


def guest_kernel() -> GuestKernel:
    """Fetch and unpack the cloud kernel once (file lock: parallel test runs share it)."""
    root = cache_dir() / "test-guest"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = sorted(root.glob("linux-image-*/boot/vmlinuz-*"))
        if not done:
            pkg = _versioned_package()
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                subprocess.run(
                    ["apt-get", "download", "-qq", pkg], cwd=tmp, check=True, capture_output=True
                )
                (deb,) = Path(tmp).glob("*.deb")
                staging = Path(tmp) / "x"
                subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
                os.replace(staging, root / pkg)
            done = sorted(root.glob("linux-image-*/boot/vmlinuz-*"))
    vmlinuz = done[-1]
    release = vmlinuz.name.removeprefix("vmlinuz-")
    kroot = vmlinuz.parent.parent / "lib" / "modules" / release / "kernel"
    modules = {p.stem: p for p in kroot.rglob("*.ko") if p.stem in MODULES}
    missing = set(MODULES) - set(modules)
    if missing:
        raise RuntimeError(f"kernel {release} lacks modules {sorted(missing)}")
    return GuestKernel(vmlinuz=vmlinuz, modules=modules, release=release)


def _newc_entry(out: io.BytesIO, name: str, mode: int, data: bytes, ino: int) -> None:
    namez = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(namez), 0]
    out.write(b"070701" + b"".join(b"%08X" % f for f in fields))
    out.write(namez)
    out.write(b"\0" * (-(110 + len(namez)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio "newc" archive (what the kernel unpacks as an initramfs)."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate(entries, start=1):
        _newc_entry(out, name, mode, data, ino)
    _newc_entry(out, "TRAILER!!!", 0, b"", 0)
    return out.getvalue()


INIT_PROLOGUE = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t devtmpfs dev /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
for m in {early}; do insmod /lib/$m.ko; done
late() {{ for m in {late}; do insmod /lib/$m.ko; done; }}
"""


def initramfs(kernel: GuestKernel, script: str, where: Path) -> Path:
    """An initramfs whose /init runs the prologue (busybox, devtmpfs, the early
    modules, a shell function ``late`` that loads the rest) then ``script``; cached
    by content under ``where``."""
    init = INIT_PROLOGUE.format(early=" ".join(EARLY_MODULES), late=" ".join(LATE_MODULES))
    init += script
    busybox = shutil.which("busybox") or "/bin/busybox"
    entries: list[tuple[str, int, bytes]] = [
        ("bin", 0o040755, b""),
        ("dev", 0o040755, b""),
        ("proc", 0o040755, b""),
        ("sys", 0o040755, b""),
        ("lib", 0o040755, b""),
        ("bin/busybox", 0o100755, Path(busybox).read_bytes()),
        ("init", 0o100755, init.encode()),
    ]
    entries += [(f"lib/{m}.ko", 0o100644, kernel.modules[m].read_bytes()) for m in MODULES]
    blob = newc(entries)
    target = where / f"initrd-{hashlib.sha256(blob).hexdigest()[:16]}.cpio"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, target)
    return target
