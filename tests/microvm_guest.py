"""A throwaway guest for VMM and network tests: the platform's guest kernel plus a
busybox initramfs whose /init is a shell script.

The VMM layer (``dsec.backends.microvm``) and the VM network (``dsec.net.vmtap``) must be
testable without the real guest's pid 1 (``dsec-vminit``), so this builds the smallest
guest that exercises what they care about. The kernel, the cpio writer and the module
dependency order are the platform's own (``dsec.guest.kernel``, ``dsec.guest.initramfs``):
one fetch, one format.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from dsec.guest import kernel as platform_kernel
from dsec.guest.initramfs import Entry, load_order, module_index, newc_archive

# Load order matters: each module's dependencies come first. The late ones are
# loaded by the script's `late` call: after the GO of a template restore, as in the
# real guest, so a restored VM probes the drives and NIC it was restored with.
EARLY_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
LATE_MODULES = ("virtio_blk", "failover", "net_failover", "virtio_net")


@dataclass(frozen=True)
class GuestKernel:
    vmlinuz: Path
    modules: Path  # <release> module tree (module_index reads it)
    release: str


def guest_kernel() -> GuestKernel:
    """The platform's guest kernel (fetched and unpacked once, cached)."""
    k = platform_kernel.guest_kernel()
    return GuestKernel(vmlinuz=k.vmlinuz, modules=k.modules, release=k.release)


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
    modules, a shell function ``late`` that loads the rest, dependencies resolved)
    then ``script``; cached by content under ``where``."""
    order = load_order([EARLY_MODULES, LATE_MODULES], module_index(kernel.modules))
    early = [name for phase, name, _ in order if phase == 0]
    late = [name for phase, name, _ in order if phase == 1]
    init = INIT_PROLOGUE.format(early=" ".join(early), late=" ".join(late)) + script
    busybox = shutil.which("busybox") or "/bin/busybox"
    entries = [
        *(
            Entry(d, stat.S_IFDIR | 0o755)
            for d in ("bin", "dev", "proc", "sys", "etc", "tmp", "lib")
        ),
        Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        Entry("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes()),
        Entry("init", stat.S_IFREG | 0o755, init.encode()),
        *(Entry(f"lib/{name}.ko", stat.S_IFREG | 0o644, data) for _, name, data in order),
    ]
    blob = newc_archive(entries)
    target = where / f"initrd-{hashlib.sha256(blob).hexdigest()[:16]}.cpio"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, target)
    return target
