"""Starting a full VM from a snapshot VM image: checks and the machine's shape.

QEMU restores a saved state only into an identical machine, so a sandbox started
from a snapshot (``VMImage.state``) runs with the snapshot's guest RAM, vCPUs,
display and firmware, not its spec's; what the spec still decides is checked here
before any work: its memory limit must hold the saved RAM (admission counted the
spec's), its firmware must be the saved one, and the host's accelerator must be the
one the state was saved under (KVM and TCG save different CPU states).
"""

from __future__ import annotations

import dataclasses

from dsec.api.spec import DSecFullVMRunArgs
from dsec.backends.fullvm.machine import FullVMConfig
from dsec.errors import InvalidArgument, LimitExceeded, Unsupported
from dsec.images.vmdisk import VMImage, VMMachine


def check(image: VMImage, spec: DSecFullVMRunArgs) -> VMMachine | None:
    """The saved machine of a snapshot image (None: an ordinary image, booted)."""
    if image.state is None:
        return None
    saved = image.machine
    if saved is None:
        raise InvalidArgument(f"VM image {spec.vm_image} has a saved state but no machine")
    if spec.memory_limit_mb < saved.memory_mb:
        raise LimitExceeded(
            f"memory_limit_mb={spec.memory_limit_mb} is below the {saved.memory_mb} MiB of "
            f"guest RAM snapshot {spec.vm_image} was saved with",
            minimum_mb=saved.memory_mb,
        )
    if spec.firmware != saved.firmware:
        raise InvalidArgument(
            f"snapshot {spec.vm_image} was saved under firmware={saved.firmware!r}, "
            f"not {spec.firmware!r}"
        )
    return saved


def check_accel(saved: VMMachine, accel: str) -> None:
    if saved.accel != accel:
        raise Unsupported(
            f"the snapshot was saved under {saved.accel}; this host runs VMs under {accel}",
            backend="fullvm",
            capability=f"snapshot_restore_{saved.accel}",
        )


def shaped(config: FullVMConfig, saved: VMMachine) -> FullVMConfig:
    """``config`` with the saved machine's shape (what QEMU's restore must match)."""
    return dataclasses.replace(
        config,
        memory_mb=saved.memory_mb,
        vcpus=saved.vcpus,
        firmware=saved.firmware,
        display=saved.display,
    )
