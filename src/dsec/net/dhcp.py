"""A DHCP responder for VM taps: a guest booting its own OS configures itself.

Why: a microVM (or a full VM that carries its kernel) is told its address on its
kernel command line (``dsec.ip=``), but an OS booting from its own disk (a desktop
image, Windows, Android) only knows to ask DHCP. The platform already assigned the
tap's slot a /30 (``dsec.net.vmtap``): the guest's address, the gateway (also its DNS
server, every UDP 53 goes to the responder anyway). This module answers the guest's
DHCPDISCOVER/DHCPREQUEST with exactly that lease and nothing else.

How: one UDP socket per tap, bound to 0.0.0.0:67 with ``SO_BINDTODEVICE`` on that tap
(so the edges sharing a host, each with its own taps, never collide on port 67, and a
packet from one tap is never answered with another's lease), read on the edge's event
loop. Replies go out the same tap as broadcasts (RFC 2131 allows it; a client without
an address cannot answer ARP), or unicast to ``ciaddr`` for a renewing client that has
its address (it listens on that address, not on broadcast).

Hostile input: everything a guest sends is untrusted. Parsing is bounded (one datagram
of at most ``MAX_PACKET`` bytes, at most ``MAX_OPTIONS`` options, every length checked
against the buffer), nothing in a request changes what is answered except the echoed
transaction id and hardware address and the message type, and replies per tap are
rate-limited (``RATE``/``BURST``) so a flooding guest costs the edge nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from dataclasses import dataclass

from dsec.net.dnsguard import TokenBucket

log = logging.getLogger(__name__)

SERVER_PORT = 67
CLIENT_PORT = 68
MAGIC = b"\x63\x82\x53\x63"
HEADER = 236  # the fixed BOOTP part, before the magic cookie
MAX_PACKET = 1500
MAX_OPTIONS = 64
LEASE_SECONDS = 0xFFFFFFFF  # infinite: the address is the slot's for the sandbox's life
RATE = 10.0  # replies per second per tap, with a burst of
BURST = 20

# message types (option 53)
DISCOVER, OFFER, REQUEST, DECLINE, ACK, NAK, RELEASE, INFORM = 1, 2, 3, 4, 5, 6, 7, 8
# options
OPT_PAD, OPT_END = 0, 255
OPT_MASK, OPT_ROUTER, OPT_DNS, OPT_REQUESTED, OPT_LEASE, OPT_TYPE, OPT_SERVER = (
    1, 3, 6, 50, 51, 53, 54,
)  # fmt: skip
OPT_T1, OPT_T2 = 58, 59


@dataclass(frozen=True)
class Lease:
    """What the platform assigned to one tap: the only answer it ever gets."""

    ip: str
    gateway: str
    prefixlen: int


@dataclass(frozen=True)
class Request:
    """The few fields of a client's message that a reply uses."""

    kind: int  # DISCOVER, REQUEST, ...
    xid: bytes  # 4 bytes, echoed
    flags: bytes  # 2 bytes, echoed
    ciaddr: str
    chaddr: bytes  # 16 bytes, echoed
    requested: str | None  # option 50


def parse(data: bytes) -> Request | None:
    """A BOOTREQUEST from an Ethernet client, None for anything else (bounded: never
    reads past ``data``, at most ``MAX_OPTIONS`` options)."""
    if len(data) < HEADER + len(MAGIC) or len(data) > MAX_PACKET:
        return None
    op, htype, hlen = data[0], data[1], data[2]
    if op != 1 or htype != 1 or hlen != 6 or data[HEADER : HEADER + 4] != MAGIC:
        return None
    kind: int | None = None
    requested: str | None = None
    pos, seen = HEADER + 4, 0
    while pos < len(data) and seen < MAX_OPTIONS:
        code = data[pos]
        if code == OPT_END:
            break
        if code == OPT_PAD:
            pos += 1
            continue
        if pos + 1 >= len(data):
            return None
        size = data[pos + 1]
        value = data[pos + 2 : pos + 2 + size]
        if len(value) != size:
            return None
        if code == OPT_TYPE and size == 1:
            kind = value[0]
        elif code == OPT_REQUESTED and size == 4:
            requested = socket.inet_ntoa(value)
        pos += 2 + size
        seen += 1
    if kind is None:
        return None
    return Request(
        kind=kind,
        xid=data[4:8],
        flags=data[10:12],
        ciaddr=socket.inet_ntoa(data[12:16]),
        chaddr=data[28:44],
        requested=requested,
    )


def _option(code: int, value: bytes) -> bytes:
    return bytes([code, len(value)]) + value


def reply(req: Request, lease: Lease) -> bytes | None:
    """The answer to ``req`` with ``lease`` (None: no answer). DISCOVER gets an OFFER;
    a REQUEST for the lease's address (or for none, while renewing) an ACK, for any
    other address a NAK; everything else (RELEASE, DECLINE, INFORM, ...) nothing."""
    if req.kind == DISCOVER:
        kind = OFFER
    elif req.kind == REQUEST:
        asked = req.requested or (req.ciaddr if req.ciaddr != "0.0.0.0" else None)
        kind = ACK if asked in (None, lease.ip) else NAK
    else:
        return None
    mask = ipaddress.IPv4Network(f"0.0.0.0/{lease.prefixlen}").netmask
    server = socket.inet_aton(lease.gateway)
    yiaddr = socket.inet_aton(lease.ip) if kind != NAK else bytes(4)
    header = (
        bytes([2, 1, 6, 0])  # BOOTREPLY, Ethernet, 6-byte addresses, no hops
        + req.xid
        + bytes(2)  # secs
        + req.flags
        + (socket.inet_aton(req.ciaddr) if kind == ACK else bytes(4))
        + yiaddr
        + server  # siaddr
        + bytes(4)  # giaddr
        + req.chaddr
        + bytes(64 + 128)  # sname, file
    )
    opts = _option(OPT_TYPE, bytes([kind])) + _option(OPT_SERVER, server)
    if kind != NAK:
        opts += (
            _option(OPT_LEASE, struct.pack("!I", LEASE_SECONDS))
            + _option(OPT_T1, struct.pack("!I", LEASE_SECONDS))
            + _option(OPT_T2, struct.pack("!I", LEASE_SECONDS))
            + _option(OPT_MASK, mask.packed)
            + _option(OPT_ROUTER, server)
            + _option(OPT_DNS, server)
        )
    return header + MAGIC + opts + bytes([OPT_END])


@dataclass
class _Tap:
    sock: socket.socket
    lease: Lease
    bucket: TokenBucket


class DhcpResponder:
    """The per-tap responders of one edge, on its event loop."""

    def __init__(self) -> None:
        self._taps: dict[str, _Tap] = {}
        self.answered = 0  # replies sent (tests, metrics)

    def add(self, ifname: str, lease: Lease) -> None:
        """Answer DHCP on tap ``ifname`` with ``lease`` from now on (idempotent; the
        tap must exist). OSError if the socket cannot be made."""
        self.remove(ifname)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sock.setblocking(False)
            sock.bind(("0.0.0.0", SERVER_PORT))
            asyncio.get_running_loop().add_reader(sock.fileno(), self._read, ifname)
        except BaseException:
            sock.close()
            raise
        self._taps[ifname] = _Tap(sock, lease, TokenBucket(RATE, BURST, time.monotonic))

    def remove(self, ifname: str) -> None:
        tap = self._taps.pop(ifname, None)
        if tap is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(tap.sock.fileno())
        tap.sock.close()

    def close(self) -> None:
        for ifname in list(self._taps):
            self.remove(ifname)

    def _read(self, ifname: str) -> None:
        tap = self._taps.get(ifname)
        if tap is None:
            return
        for _ in range(16):  # bounded work per wakeup
            try:
                data = tap.sock.recv(MAX_PACKET + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # the tap went away under the socket
                log.debug("dhcp on %s: %s", ifname, exc)
                return
            req = parse(data)
            if req is None:
                continue
            answer = reply(req, tap.lease)
            if answer is None or not tap.bucket.take():
                continue
            renewing = req.kind == REQUEST and req.ciaddr == tap.lease.ip
            dest = tap.lease.ip if renewing else "255.255.255.255"
            try:
                tap.sock.sendto(answer, (dest, CLIENT_PORT))
                self.answered += 1
            except OSError as exc:
                log.debug("dhcp reply on %s: %s", ifname, exc)
