"""VM images: what one is (``VMImage``, kept in the image's config) and the check a
disk passes before it is trusted.

A VM image is an image of the registry whose ``layers`` are blobs of the layer store
that are not EROFS layers: its disk (raw or qcow2) and, for a direct kernel boot, its
kernel and initrd; ``config["vm"]`` says which blob is which. So VM images are
content-addressed, listed, fetched from the shared store and garbage-collected like
layered images, and the fullvm backend boots each sandbox from a private overlay of
the shared disk (dsec.backends.fullvm.disk).

Why disks are inspected on import: a qcow2 file names its own backing file and may
name an external data file; an uploaded one naming ``/etc/shadow`` would hand that
file to the guest as its disk. Only raw and self-contained qcow2 images are accepted
(``qemu-img info`` with the format forced, never probed, on the upload).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dsec.api.fields import check_network_rules
from dsec.errors import BackendError, InvalidArgument
from dsec.images.store import normalize_digest

DiskFormat = Literal["raw", "qcow2"]
QCOW2_MAGIC = b"QFI\xfb"
MAX_CMDLINE = 2048


@dataclass(frozen=True)
class DiskInfo:
    format: DiskFormat
    virtual_size: int


def qemu_img(argv: list[str], what: str, timeout: float = 60) -> str:
    try:
        proc = subprocess.run(
            ["qemu-img", *argv], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendError(f"qemu-img could not {what}: {exc}") from exc
    if proc.returncode != 0:
        raise BackendError(f"qemu-img could not {what}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def detect_format(path: Path) -> DiskFormat:
    """qcow2 by its magic, raw otherwise (a raw image is any bytes)."""
    with open(path, "rb") as fh:
        return "qcow2" if fh.read(4) == QCOW2_MAGIC else "raw"


def inspect(path: Path, fmt: DiskFormat) -> DiskInfo:
    """What ``path`` is when read as ``fmt``; InvalidArgument for an image that would
    reach any other file (a backing file, an external data file)."""
    out = qemu_img(["info", "--output=json", "-f", fmt, "-U", str(path)], "read the image")
    try:
        doc = json.loads(out)
    except ValueError as exc:
        raise BackendError(f"qemu-img info gave no JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BackendError("qemu-img info gave no JSON object")
    if doc.get("backing-filename") or doc.get("full-backing-filename"):
        raise InvalidArgument("a VM image must not name a backing file (flatten it first)")
    specific = doc.get("format-specific")
    data = specific.get("data") if isinstance(specific, dict) else None
    if isinstance(data, dict) and data.get("data-file"):
        raise InvalidArgument("a VM image must not name an external data file")
    size = doc.get("virtual-size")
    if not isinstance(size, int) or size <= 0:
        raise InvalidArgument("the VM image has no virtual size")
    return DiskInfo(fmt, size)


@dataclass(frozen=True)
class VMMachine:
    """The shape of the machine a VM snapshot was saved from. QEMU restores a saved
    state only into an identical machine (guest RAM, vCPUs, display adapter, firmware,
    accelerator), so a sandbox started from a snapshot gets this shape, not its spec's.

    ``nic``: the saved machine has a virtio-net NIC (its VM had network rules), so a
    sandbox started from it needs a network too; ``network_rules``: the rules the VM had
    when saved, which such a sandbox gets when its spec names none (checked against the
    edge's catalog like any spec's)."""

    memory_mb: int
    vcpus: int
    firmware: Literal["bios", "uefi"]
    display: tuple[int, int]
    accel: Literal["kvm", "tcg"]
    nic: bool = False
    network_rules: dict[str, bool] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self), "display": list(self.display)}
        if not self.nic:  # the shape of snapshots made before NICs were saved
            del out["nic"], out["network_rules"]
        return out

    @classmethod
    def from_json(cls, data: object, ref: str) -> VMMachine:
        """Checked field by field: the config came from a registry (InvalidArgument)."""
        if not isinstance(data, dict):
            raise InvalidArgument(f"VM image {ref} has an invalid saved machine")
        mem, cpus, fw = data.get("memory_mb"), data.get("vcpus"), data.get("firmware")
        disp, accel = data.get("display"), data.get("accel")
        if (
            not isinstance(mem, int)
            or not isinstance(cpus, int)
            or mem < 64
            or not 1 <= cpus <= 1024
            or fw not in ("bios", "uefi")
            or accel not in ("kvm", "tcg")
            or not isinstance(disp, list)
            or len(disp) != 2
            or not all(isinstance(v, int) and 0 < v <= 16384 for v in disp)
        ):
            raise InvalidArgument(f"VM image {ref} has an invalid saved machine")
        nic, rules = data.get("nic", False), data.get("network_rules")
        if not isinstance(nic, bool) or not (rules is None or _rules_ok(rules)):
            raise InvalidArgument(f"VM image {ref} has an invalid saved network")
        return cls(mem, cpus, fw, (disp[0], disp[1]), accel, nic, rules)


def _rules_ok(rules: object) -> bool:
    """A saved rules dict of the spec's shape (dsec.api.fields.check_network_rules)."""
    if not isinstance(rules, dict) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in rules.items()
    ):
        return False
    try:
        check_network_rules(rules)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class VMImage:
    """Which blobs of an image make a VM: ``config["vm"]`` of its manifest.

    A *snapshot* VM image (``sb.snapshot``) also names ``state``: the saved memory and
    device state a new VM restores instead of booting, and the ``machine`` it needs."""

    disk: str  # digest
    format: DiskFormat
    virtual_size: int
    kernel: str | None = None  # digests, for a direct kernel boot
    initrd: str | None = None
    cmdline: str | None = None
    state: str | None = None  # digest of a saved VM state (a snapshot image)
    machine: VMMachine | None = None  # with ``state``: the shape to restore into

    def blobs(self) -> list[str]:
        """Every blob the VM reads, the disk first (the image's ``layers``)."""
        return [d for d in (self.disk, self.kernel, self.initrd, self.state) if d is not None]

    def to_config(self) -> dict[str, Any]:
        vm = {k: v for k, v in asdict(self).items() if v is not None and k != "machine"}
        if self.machine is not None:
            vm["machine"] = self.machine.to_json()
        return {"vm": vm}

    @classmethod
    def of(cls, config: Mapping[str, object], ref: str) -> VMImage:
        """The VM part of an image's config; InvalidArgument (naming ``ref``) for an
        image that is not a VM image. Every field is checked: the config came from a
        registry another edge may have written."""
        vm = config.get("vm")
        if not isinstance(vm, dict):
            raise InvalidArgument(
                f"image {ref} is not a VM image (import one with `dsec image import-vm`)",
                image=ref,
            )

        def digest(key: str, required: bool = False) -> str | None:
            value = vm.get(key)
            if value is None and not required:
                return None
            if not isinstance(value, str):
                raise InvalidArgument(f"VM image {ref} has no valid {key}")
            return normalize_digest(value)

        fmt = vm.get("format")
        size = vm.get("virtual_size")
        cmdline = vm.get("cmdline")
        if fmt not in ("raw", "qcow2") or not isinstance(size, int) or size <= 0:
            raise InvalidArgument(f"VM image {ref} has no valid disk format or size")
        if cmdline is not None and (not isinstance(cmdline, str) or len(cmdline) > MAX_CMDLINE):
            raise InvalidArgument(f"VM image {ref} has an invalid kernel command line")
        disk = digest("disk", required=True)
        assert disk is not None
        state = digest("state")
        machine = VMMachine.from_json(vm.get("machine"), ref) if state is not None else None
        return cls(disk, fmt, size, digest("kernel"), digest("initrd"), cmdline, state, machine)


def check_cmdline(cmdline: str) -> str:
    if len(cmdline) > MAX_CMDLINE or any(not c.isprintable() for c in cmdline):
        raise InvalidArgument(f"a kernel command line is printable and at most {MAX_CMDLINE} chars")
    return cmdline
