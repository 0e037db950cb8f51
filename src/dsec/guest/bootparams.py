"""The guest boot contract's names and parameters, in one place for the host side.

Why here: dsec-vminit.c parses these from /proc/cmdline (or from the host's GO in
template mode) and powers the VM off on a bad one, which costs a boot to find out; the
host checks the same rules first and raises InvalidArgument instead.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from dsec.errors import InvalidArgument

BASE_ARGS = "console=ttyS0 quiet panic=-1 tsc_early_khz=2000000 lpj=4000000 pci=off"
"""Always on the kernel command line. Without tsc_early_khz/lpj the microvm machine
(no PIT, no HPET) hangs calibrating the TSC; pci=off because its devices are
virtio-mmio."""

PORT_NAME = "dsec.agent"
"""Name of the virtio-serial port (``-device virtserialport,name=...``)."""
RW_SERIAL = "dsec-rw"
"""virtio-blk serial of the writable ext4 disk."""
MAX_LAYERS = 32

_HOSTNAME = re.compile(r"^[A-Za-z0-9.-]{1,64}$")


def layer_serial(index: int) -> str:
    """virtio-blk serial of read-only layer ``index``; 0 is the TOP layer (overlayfs
    lowerdir order). The guest finds drives by serial, never by attachment order."""
    return f"dsec-l{index}"


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
        return out

    def cmdline(self) -> str:
        """The whole kernel command line of a cold boot."""
        return " ".join([BASE_ARGS, *(f"dsec.{k}={v}" for k, v in self.params().items())])


def template_cmdline() -> str:
    """The kernel command line of a template boot: the guest waits for GO (carrying
    ``BootParams.params()``) before it touches any drive or network card."""
    return f"{BASE_ARGS} dsec.wait=1"
