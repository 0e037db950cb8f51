"""Each full VM's private disk: a qcow2 copy-on-write overlay of its image's disk.

A full VM boots from a shared, read-only base image (a blob of the layer store) through
a private qcow2 overlay in its own directory: creating one is a metadata write
(milliseconds), every write of the guest lands in the overlay only, and the overlay's
virtual size caps what the guest can ever make it grow to, so it is sized by
``disk_limit_mb`` (never below the base, which the guest must see whole).
"""

from __future__ import annotations

import os
from pathlib import Path

from dsec.errors import LimitExceeded
from dsec.images.vmdisk import DiskFormat, DiskInfo, qemu_img

MiB = 1 << 20


def create_overlay(path: Path, base: Path, base_format: DiskFormat, size: int) -> None:
    """The sandbox's qcow2 overlay at ``path`` over ``base`` (read-only to it),
    ``size`` bytes of virtual disk; nothing left behind on failure."""
    try:
        qemu_img(
            [
                "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on",
                "-F", base_format, "-b", str(base), str(path), str(size),
            ],
            "create the VM's overlay",
        )  # fmt: skip
        os.chmod(path, 0o600)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def overlay_size(base: DiskInfo, disk_limit_mb: int | None) -> int:
    """The overlay's virtual size: ``disk_limit_mb`` (LimitExceeded below the base
    image's size, which the guest must see whole), or the base's own size."""
    if disk_limit_mb is None:
        return base.virtual_size
    size = disk_limit_mb * MiB
    if size < base.virtual_size:
        raise LimitExceeded(
            f"disk_limit_mb={disk_limit_mb} is smaller than the VM image's disk "
            f"({-(-base.virtual_size // MiB)} MiB)",
            minimum_mb=-(-base.virtual_size // MiB),
        )
    return size
