"""The guest boot contract's names and parameters, in one place for the host side.

Why here: dsec-vminit.c parses these from /proc/cmdline (or from the host's GO in
template mode) and powers the VM off on a bad one, which costs a boot to find out; the
host checks the same rules first and raises InvalidArgument instead.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from dataclasses import dataclass

from dsec.api.protected import MAX_PROTECTED_MOUNTS
from dsec.api.verify import MAX_GRADED_PATHS, check_graded_path
from dsec.errors import InvalidArgument

BASE_ARGS = "console=ttyS0 quiet panic=-1 tsc_early_khz=2000000 lpj=4000000 pci=off"
"""Always on the kernel command line. Without tsc_early_khz/lpj the microvm machine
(no PIT, no HPET) hangs calibrating the TSC; pci=off because its devices are
virtio-mmio."""

PORT_NAME = "dsec.agent"
"""Name of the virtio-serial port (``-device virtserialport,name=...``)."""
RW_SERIAL = "dsec-rw"
"""virtio-blk serial of the writable ext4 disk."""
AGENT_DISK_SERIAL = "dsec-agent"
"""virtio-blk serial, in a verifier VM, of the copy-on-write view of the agent's disk
(only data for the graded paths: never the verifier's root)."""
PACK_DISK_SERIAL = "dsec-out"
"""virtio-blk serial, in a packer VM, of the drive the agent's changes go to, as a tar."""
MAX_LAYERS = 32
MAX_PATH_PARAM = 1024
"""Bytes of one graded= or protected= value (dsec-vminit.c's buffers)."""
MAX_PARAMS_TEXT = 4000
"""All boot parameters together must fit the guest's GO frame (MAX_GO = 4096)."""

_HOSTNAME = re.compile(r"^[A-Za-z0-9.-]{1,64}$")


def layer_serial(index: int) -> str:
    """virtio-blk serial of read-only layer ``index``; 0 is the TOP layer (overlayfs
    lowerdir order). The guest finds drives by serial, never by attachment order."""
    return f"dsec-l{index}"


def protected_serial(index: int) -> str:
    """virtio-blk serial of protected drive ``index`` (verifier VMs only): an EROFS
    image whose root is shown read-only at ``BootParams.protected[index]``."""
    return f"dsec-p{index}"


def _check_protected_path(path: str) -> str:
    norm = posixpath.normpath(path)
    if (
        not path.startswith("/")
        or norm != path
        or norm == "/"
        or norm.startswith("//")
        or len(path) > 255
        or any(c in path for c in ",:\\=")
        or any(not c.isprintable() or c.isspace() for c in path)
    ):
        raise InvalidArgument(f"bad protected path for a microVM: {path!r}")
    return path


@dataclass(frozen=True, slots=True)
class BootParams:
    layers: int
    """Number of read-only EROFS layer drives (at least 1)."""
    rw: bool
    """A writable drive exists (else the guest's upper layer is a tmpfs)."""
    ip: str | None = None
    """``A.B.C.D/P`` for eth0 (virtio-net), or None for no network configuration."""
    gw: str | None = None
    hostname: str | None = None
    time_us: int | None = None
    """The host's clock (microseconds since the epoch) for the guest to set: a guest
    restored from a template or a pause otherwise runs on the snapshot's time."""
    verify: bool = False
    """A verifier VM: the layers are the sandbox's pristine ones, ``rw`` must be False
    (a tmpfs upper), the agent's disk view is drive ``dsec-agent``."""
    graded: tuple[str, ...] = ()
    """Verifier only: the agent's changes under these paths are shown read-only."""
    protected: tuple[str, ...] = ()
    """Verifier only: drive ``dsec-p<i>`` is shown read-only at ``protected[i]``."""
    pack: bool = False
    """A packer VM (a verifier without graded paths): the agent's upper is written as
    a tar to drive ``dsec-out`` before the guest's agent starts (dsec.backends.microvm.pack)."""

    def __post_init__(self) -> None:
        if not 1 <= self.layers <= MAX_LAYERS:
            raise InvalidArgument(f"a microVM needs 1 to {MAX_LAYERS} layers, not {self.layers}")
        if self.ip is not None:
            try:
                iface = ipaddress.IPv4Interface(self.ip)
            except ValueError as exc:
                raise InvalidArgument(f"bad guest address {self.ip!r}: {exc}") from None
            if "/" not in self.ip or iface.network.prefixlen == 0:
                raise InvalidArgument(f"guest address {self.ip!r} needs a prefix /1../32")
        if self.gw is not None:
            if self.ip is None:
                raise InvalidArgument("a guest gateway needs a guest address")
            try:
                ipaddress.IPv4Address(self.gw)
            except ValueError as exc:
                raise InvalidArgument(f"bad guest gateway {self.gw!r}: {exc}") from None
        if self.hostname is not None and not _HOSTNAME.match(self.hostname):
            raise InvalidArgument(f"bad guest hostname {self.hostname!r}")
        if self.time_us is not None and self.time_us <= 0:
            raise InvalidArgument(f"bad guest clock {self.time_us!r}")
        if not self.verify and (self.graded or self.protected or self.pack):
            raise InvalidArgument("graded and protected paths exist only in a verifier VM")
        if self.pack and (self.graded or self.protected):
            raise InvalidArgument("a packer VM shows no graded or protected paths")
        if self.verify and self.rw:
            raise InvalidArgument("a verifier VM has no writable disk of its own (rw=False)")
        if len(self.graded) > MAX_GRADED_PATHS:
            raise InvalidArgument(f"at most {MAX_GRADED_PATHS} graded paths")
        if len(self.protected) > MAX_PROTECTED_MOUNTS:
            raise InvalidArgument(f"at most {MAX_PROTECTED_MOUNTS} protected paths")
        for path in self.graded:
            try:
                if check_graded_path(path) != path:
                    raise ValueError(f"graded path {path!r} is not normalised")
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        for path in self.protected:
            _check_protected_path(path)
        for key in ("graded", "protected"):
            if len(",".join(getattr(self, key))) > MAX_PATH_PARAM:
                raise InvalidArgument(f"the {key} paths are longer than {MAX_PATH_PARAM} bytes")
        if len(" ".join(f"dsec.{k}={v}" for k, v in self.params().items())) > MAX_PARAMS_TEXT:
            raise InvalidArgument("the boot parameters are too long for the guest")

    def params(self) -> dict[str, str]:
        """The ``dsec.*`` keys without their prefix, as GuestChannel.go takes them."""
        out = {"layers": str(self.layers), "rw": "1" if self.rw else "0"}
        if self.ip is not None:
            out["ip"] = self.ip
        if self.gw is not None:
            out["gw"] = self.gw
        if self.hostname is not None:
            out["hostname"] = self.hostname
        if self.time_us is not None:
            out["time"] = str(self.time_us)
        if self.verify:
            out["verify"] = "1"
        if self.pack:
            out["pack"] = "1"
        if self.graded:
            out["graded"] = ",".join(self.graded)
        if self.protected:
            out["protected"] = ",".join(self.protected)
        return out

    def cmdline(self) -> str:
        """The whole kernel command line of a cold boot."""
        return " ".join([BASE_ARGS, *(f"dsec.{k}={v}" for k, v in self.params().items())])


def template_cmdline() -> str:
    """The kernel command line of a template boot: the guest waits for GO (carrying
    ``BootParams.params()``) before it touches any drive or network card."""
    return f"{BASE_ARGS} dsec.wait=1"
