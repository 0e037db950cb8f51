"""A full VM's NIC: virtio-net-pci on the sandbox's tap (dsec.net.vmtap), only for a
sandbox with network rules (a VM without rules has no NIC at all).

The tap is the microVM's: the edge's NetworkManager makes one persistent tap per slot
in the host namespace, behind the same nftables egress rules, DNS responder and
NFLOG; the backend opens it for each QEMU launch (create, and every resume from a
pause file) and hands QEMU the fd, so the jailed QEMU needs no network privilege.

The fd's number differs per launch while the command line is saved once
(``machine.Launch``, for resumes after an edge restart): the saved argv holds
``TAP_FD`` where the number goes, and ``with_fd`` fills it in at spawn. The device
set does not change between launches, which is what a restore needs.

The guest's address: the platform tells a guest that carries its kernel (direct
boot) ``dsec.ip=A.B.C.D/30 dsec.gw=G`` on its kernel command line (the gateway is also
its DNS server: every UDP 53 goes to the responder); the project's test image
configures eth0 from it (dsec.guest.vmimage). A guest booting from its own disk asks
DHCP, like any OS: the edge answers on the tap with that same address, gateway and DNS
server and nothing else (dsec.net.dhcp); debian-desktop does (dsec.guest.desktopimage).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from dsec.backends.microvm.qmp import Qmp
from dsec.errors import BackendError
from dsec.net.vmtap import PREFIXLEN

TAP_FD = "@TAP_FD@"  # in a saved argv: where the launch's tap fd number goes
NETDEV = "n0"
# How long the cable stays unplugged after a restore: long enough for the guest's
# network daemon to see the carrier go (under TCG too), short next to a restore.
LINK_DOWN_SECONDS = 2.0


def qemu_args(mac: str) -> list[str]:
    """``-netdev``/``-device`` for q35 (PCI), the fd left as ``TAP_FD``."""
    return [
        "-netdev", f"tap,id={NETDEV},fd={TAP_FD}",
        "-device", f"virtio-net-pci,netdev={NETDEV},mac={mac}",
    ]  # fmt: skip


def with_fd(argv: Sequence[str], tap_fd: int | None) -> list[str]:
    """``argv`` with the tap's fd number filled in (BackendError: a VM with a NIC
    launched without its tap, or a tap for a VM without a NIC)."""
    wants = any(TAP_FD in a for a in argv)
    if wants != (tap_fd is not None):
        raise BackendError(
            "this VM has a NIC but no tap was opened for it"
            if wants
            else "a tap was opened for a VM without a NIC"
        )
    if tap_fd is None:
        return list(argv)
    return [a.replace(TAP_FD, str(tap_fd)) for a in argv]


def guest_cmdline(net: Mapping[str, Any]) -> str:
    """The kernel parameters telling a direct-boot guest its address (the boot
    contract of microVM guests: ``dsec.ip=`` and ``dsec.gw=``), from the network
    record the edge attached (its slot's address, stable across resumes)."""
    return f"dsec.ip={net['ip']}/{PREFIXLEN} dsec.gw={net['gateway']}"


async def relink(qmp: Qmp, *, down_seconds: float = LINK_DOWN_SECONDS) -> None:
    """Unplug and replug the NIC's cable (QMP ``set_link``; virtio-net tells the guest
    through its link status). A guest restored from a snapshot still holds the address
    of the VM it was saved from, on a new tap whose slot has another one; a DHCP client
    that watches the carrier (systemd-networkd, NetworkManager, Windows, Android) asks
    again when the cable comes back, is NAKed for the old address (dsec.net.dhcp) and
    takes the new slot's lease. Nothing in the guest is trusted or required: a guest
    that ignores the carrier keeps a dead address, confined to its slot like any."""
    await qmp.execute("set_link", {"name": NETDEV, "up": False})
    await asyncio.sleep(down_seconds)
    await qmp.execute("set_link", {"name": NETDEV, "up": True})
