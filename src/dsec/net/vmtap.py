"""A microVM's network: one persistent tap device in the host namespace, per slot.

A container with ``network_rules`` gets a slot: a host-side veth ``<prefix><N>`` (the
gateway address of a /30) whose peer is the container's eth0, and everything the edge
enforces is keyed by that host-side name (nftables verdict map, chain ``s<N>``, set
``a<N>``, the DNS redirect, NFLOG). A microVM gets the same slot (same index, names,
addresses, chain, set, responder, audit), but the host-side device is a *tap* with that
name instead of a veth, and the guest's virtio-net eth0 holds the address the
container's eth0 would hold. Why not a netns + veth + bridge + tap as for containers:

- The guest kernel is already the sandbox's own network stack; a network namespace
  around it would only add a bridge and a veth pair (four devices and one more hop per
  packet) without separating anything that the guest does not already separate.
- Pause ends the QEMU process and an edge restart ends the edge's fds: a network
  namespace would then have no holder left and the kernel would drop it (a persistent
  tap holds no namespace), so a paused VM would need a bind mount per VM to keep its
  network. A *persistent* tap in the host namespace lives on without any holder: the
  edge re-opens it for the resumed QEMU (``attach_vm``), from the record alone.
- QEMU needs no access to any namespace: the edge opens the tap and hands QEMU the fd
  (``-netdev tap,fd=N``), so QEMU itself runs in an empty network namespace; it cannot
  open another tap (TUNSETIFF resolves names in the opener's namespace).

The datapath for the guest is the container's: the reverse-path rule, DNS redirect,
masquerade and the per-slot chain match ``iifname <prefix>*`` and the slot's name, so
``update_network`` and NFLOG work unchanged. IPv6 is off on the tap, as on the veth.
The device's owner is root (``attach_vm`` resets whatever an earlier VMM set through
its fd): the tun driver refuses TUNSETIFF on it to anyone without CAP_NET_ADMIN, and
QEMU only ever holds the fd it was given.

A tap whose last fd closed has its transmit queue turned off by the kernel's link
watcher, and a new fd gets it back only when the watcher runs again: the edge waits
for that (``link_ready``) before a guest runs, at create and before a resumed guest
continues, so that the guest loses none of the host's first replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from dsec.errors import BackendError
from dsec.net.netns import Slot

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
TUNGETIFF = 0x800454D2
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000  # QEMU's virtio-net passes offloads through it (no vhost-net here)
IFF_TUN_EXCL = 0x8000  # create only: never attach to a device someone else made
IFF_PERSIST = 0x0800  # in TUNGETIFF's flags: the device outlives its fds
FLAGS = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR
PREFIXLEN = 30
LINK_READY_S = 1.0  # the link watcher runs within ~1 ms; a host busy on the rtnl lock holds it
LINK_POLL_S = 0.0002

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VMNetAttachment:
    """What a QEMU launch needs for the guest's eth0.

    ``tap_fd`` is close-on-exec so that no other child of the edge inherits it; hand it
    to QEMU with ``subprocess.Popen(pass_fds=[tap_fd])`` (which makes it inheritable in
    that child only) and close the edge's copy after the launch (``close``)."""

    tap_fd: int
    mac: str
    guest_ip: str  # "A.B.C.D/P", for the kernel command line's dsec.ip=
    gateway: str  # for dsec.gw= (also the DNS server: every UDP 53 goes to the responder)

    def cmdline(self) -> str:
        """The guest kernel parameters of the boot contract."""
        return f"dsec.ip={self.guest_ip} dsec.gw={self.gateway}"

    def qemu_args(self, netdev: str = "n0") -> list[str]:
        """``-netdev``/``-device`` for ``-M microvm`` (virtio-mmio); the fd number is the
        same in QEMU when passed with ``pass_fds``."""
        return [
            "-netdev",
            f"tap,id={netdev},fd={self.tap_fd}",
            "-device",
            f"virtio-net-device,netdev={netdev},mac={self.mac}",
        ]

    def close(self) -> None:
        """Close the edge's copy of the fd (QEMU keeps its own)."""
        with contextlib.suppress(OSError):
            os.close(self.tap_fd)


def guest_mac(prefix: str, idx: int) -> str:
    """A locally administered unicast MAC, stable for (edge prefix, slot): the same
    after a resume or an edge restart, distinct between the slots of one edge."""
    digest = hashlib.sha1(prefix.encode()).digest()
    raw = bytes([0x02, *digest[:3], (idx >> 8) & 0xFF, idx & 0xFF])
    return ":".join(f"{b:02x}" for b in raw)


def _ifreq(ifname: str, flags: int) -> bytes:
    name = ifname.encode()
    if not name or len(name) > 15:
        raise BackendError(f"bad tap name {ifname!r}")
    return struct.pack("16sH22x", name, flags)


def _open(ifname: str, flags: int) -> int:
    """An fd attached to tap ``ifname`` (TUNSETIFF); raises OSError."""
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, _ifreq(ifname, flags))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _flags(fd: int) -> int:
    out = fcntl.ioctl(fd, TUNGETIFF, _ifreq("x", 0))
    return int(struct.unpack("16sH22x", out)[1])


def _write(path: str, value: str) -> None:
    with contextlib.suppress(OSError), open(path, "w") as fh:
        fh.write(value)


def create(host: IPRoute, slot: Slot) -> None:
    """Make the persistent tap of ``slot`` in the host namespace: gateway address, IPv6
    off, up (blocking netlink; run in the manager's netlink thread). The edge holds no
    fd afterwards: ``attach_vm`` opens one per QEMU launch."""
    try:
        fd = _open(slot.ifname, FLAGS | IFF_TUN_EXCL)
    except OSError as exc:
        raise BackendError(f"cannot create tap {slot.ifname}: {exc.strerror}") from exc
    try:
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
        _write(f"/proc/sys/net/ipv6/conf/{slot.ifname}/disable_ipv6", "1")
        idx = socket.if_nametoindex(slot.ifname)  # an ioctl; link_lookup dumps every link
        host.addr("add", index=idx, address=slot.gw, prefixlen=PREFIXLEN)
        host.link("set", index=idx, state="up")
        slot.ifindex = idx
    except BaseException:
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, TUNSETPERSIST, 0)  # so that the close below removes it
        os.close(fd)
        raise
    os.close(fd)


def attach_vm(net: dict[str, Any]) -> VMNetAttachment:
    """Open the tap of a microVM's network record (what ``NetworkManager.attach(...,
    vm=True)`` returned and the sandbox record keeps) for one QEMU launch: at create,
    and again at every resume after a pause, also after an edge restart. Plain ioctls,
    ~0.1 ms, no netlink: fine on the event loop.

    BackendError when the tap is gone (the sandbox's network was released) or another
    QEMU still holds it (a single-queue tap takes one fd)."""
    ifname = str(net["ifname"])
    if not Path(f"/sys/class/net/{ifname}/tun_flags").exists():
        raise BackendError(f"the network of this sandbox is gone (no tap {ifname})")
    try:
        fd = _open(ifname, FLAGS)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise BackendError(f"tap {ifname} is still held by another VMM process") from exc
        raise BackendError(f"cannot open tap {ifname}: {exc.strerror}") from exc
    if not _flags(fd) & IFF_PERSIST:
        # Released between the check and TUNSETIFF: the ioctl made a fresh, unconfigured
        # device, which this close removes again. Never give QEMU a dead network.
        os.close(fd)
        raise BackendError(f"the network of this sandbox is gone (no tap {ifname})")
    try:
        # Any holder of a tap fd may set the device's owner and group (the tun driver
        # checks nothing for those), and an owner may attach to it without CAP_NET_ADMIN.
        # An earlier VMM of this sandbox held such an fd: take the device back to root
        # (the driver cannot unset an owner) before the next VMM gets it.
        fcntl.ioctl(fd, TUNSETOWNER, 0)
        fcntl.ioctl(fd, TUNSETGROUP, 0)
    except OSError as exc:
        os.close(fd)
        raise BackendError(f"cannot reset tap {ifname}: {exc.strerror}") from exc
    return VMNetAttachment(
        tap_fd=fd,
        mac=str(net["mac"]),
        guest_ip=f"{net['ip']}/{PREFIXLEN}",
        gateway=str(net["gateway"]),
    )


def wait_link_ready(ifname: str, timeout: float = LINK_READY_S) -> bool:
    """Block until the kernel sends frames to the tap's fd again: True, or False after
    ``timeout`` (or when the tap is gone).

    Why: when the last fd of a tap closes (a VMM ended: pause, edge restart), the
    kernel's link watcher soon turns the device's transmit queue off; a new fd turns
    the carrier on at once, but the queue only comes back when the watcher runs again,
    a work item that needs the rtnl lock. Until then every frame the host sends to the
    guest is dropped: measured here, 34 of 100 first ARP replies to a tap re-opened
    0.3 s after its last close. A resumed guest would lose its first replies and wait
    out TCP's retransmit timer (200 ms and more). The watcher sets the operational
    state just before it turns the queue on, under the rtnl lock; reading ``speed``
    takes that lock, so it returns only after the queue is on. Blocking (the lock may
    be held long on a busy host): call it in a thread (``attach_vm_ready``)."""
    deadline = time.monotonic() + timeout
    state = Path(f"/sys/class/net/{ifname}/operstate")
    while True:
        try:
            if state.read_text().strip() == "up":
                break
        except OSError:
            return False  # the tap is gone: nothing to wait for
        if time.monotonic() >= deadline:
            return False
        time.sleep(LINK_POLL_S)
    with contextlib.suppress(OSError):  # EINVAL when the tun driver has no speed now
        Path(f"/sys/class/net/{ifname}/speed").read_text()
    return True


async def link_ready(ifname: str, timeout: float = LINK_READY_S) -> None:
    """Wait off the event loop until the host's frames reach the tap's fd
    (``wait_link_ready``, ~0.2 ms): before a guest runs, so that it loses none of its
    first replies. A link still not ready after ``timeout`` is logged, not refused:
    the guest's own retransmits cover it."""
    if not await asyncio.to_thread(wait_link_ready, ifname, timeout):
        log.warning(
            "tap %s: not carrying after %.1f s; its first frames may be lost", ifname, timeout
        )


async def attach_vm_ready(net: dict[str, Any], timeout: float = LINK_READY_S) -> VMNetAttachment:
    """``attach_vm``, then ``link_ready``: for a VMM whose guest runs at once. The fd is
    closed if this is cancelled."""
    att = attach_vm(net)
    try:
        await link_ready(str(net["ifname"]), timeout)
    except BaseException:
        att.close()
        raise
    return att


def scratch_tap() -> int:
    """An fd on a fresh, non-persistent, unconfigured tap (down, no address): the NIC
    backend of a VM whose template is being saved, which never sends a frame (its guest
    waits before it loads the NIC driver). The device vanishes with the fd's last copy,
    so nothing is left however the template build ends."""
    name = "dsect" + os.urandom(5).hex()
    try:
        return _open(name, FLAGS | IFF_TUN_EXCL)
    except OSError as exc:
        raise BackendError(f"cannot create a scratch tap: {exc.strerror}") from exc


def detach_vm(host: IPRoute, net: dict[str, Any]) -> None:
    """Remove the tap of a network record (idempotent; blocking, ~15-20 ms: the kernel
    unregisters the device synchronously, so the manager runs it in its netlink
    thread). A QEMU still attached loses its network at once."""
    with contextlib.suppress(NetlinkError):
        host.link("del", ifname=str(net["ifname"]))


def is_tap(ifname: str) -> bool:
    """Whether the host device ``ifname`` is a tun/tap device (tests, sweeps)."""
    return Path(f"/sys/class/net/{ifname}/tun_flags").exists()
