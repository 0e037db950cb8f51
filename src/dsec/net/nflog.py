"""Read the packets nftables logs with ``log group N`` (NFLOG over netlink).

A denied connection is known to the kernel only; NFLOG hands a copy of its first bytes
to one netlink socket as it happens, so the edge turns it into an audit record and an
event within milliseconds, with no polling and no per-sandbox process. The socket is
non-blocking and read from the event loop; the rules rate-limit what they log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_IFINDEX_INDEV = 4
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10


@dataclass(frozen=True)
class LoggedPacket:
    prefix: str
    indev: int
    proto: int
    src: str
    dst: str
    dport: int


def _attr(kind: int, data: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(data), kind) + data
    return raw + b"\0" * (-len(raw) % 4)


def _msg(msg_type: int, flags: int, res_id: int, attrs: bytes, family: int = 0) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(res_id)) + attrs
    return struct.pack("=IHHII", 16 + len(body), msg_type, flags, 0, 0) + body


def parse_packet(payload: bytes) -> tuple[int, str, str, int] | None:
    """(protocol, source, destination, destination port) of an IPv4 packet."""
    if len(payload) < 20 or payload[0] >> 4 != 4:
        return None
    ihl = (payload[0] & 0x0F) * 4
    proto = payload[9]
    src = socket.inet_ntoa(payload[12:16])
    dst = socket.inet_ntoa(payload[16:20])
    dport = 0
    if proto in (6, 17) and len(payload) >= ihl + 4:
        dport = struct.unpack("!H", payload[ihl + 2 : ihl + 4])[0]
    return proto, src, dst, dport


def parse_messages(data: bytes) -> list[LoggedPacket]:
    out: list[LoggedPacket] = []
    off = 0
    while off + 16 <= len(data):
        length, mtype = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if mtype == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            attrs: dict[int, bytes] = {}
            pos, end = off + 20, off + length
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                attrs[atype & 0x7FFF] = data[pos + 4 : pos + alen]
                pos += (alen + 3) & ~3
            pkt = parse_packet(attrs.get(NFULA_PAYLOAD, b""))
            if pkt is not None:
                indev = attrs.get(NFULA_IFINDEX_INDEV, b"\0\0\0\0")
                out.append(
                    LoggedPacket(
                        prefix=attrs.get(NFULA_PREFIX, b"").rstrip(b"\0").decode(errors="replace"),
                        indev=struct.unpack("!I", indev[:4])[0],
                        proto=pkt[0],
                        src=pkt[1],
                        dst=pkt[2],
                        dport=pkt[3],
                    )
                )
        off += (length + 3) & ~3
    return out


class NflogReader:
    """One NFLOG group bound to one socket; ``bind`` picks a free group number."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.group = 0
        self.handler_errors = 0
        self.broken: str | None = None  # why the socket stopped reading, if it did

    def healthy(self) -> str | None:
        """None while the socket reads; else why not (for the edge's supervisor)."""
        if self.sock is None:
            return "the NFLOG socket is closed"
        return self.broken

    def rebind(self) -> None:
        """A fresh socket on the *same* group: the nft rules name it."""
        group = self.group
        self.close()
        self.bind(group - 1024, attempts=1)
        self.broken = None

    def bind(self, first: int, attempts: int = 64) -> int:
        """Bind the first free group from ``first`` on, trying ``attempts`` groups.

        The kernel refuses a group that another socket holds with EPERM (its owner's
        port id differs), and one this socket already holds with EBUSY: both mean
        "taken, try the next". Two platforms on one host (or a test run's two workers)
        can hash to one group, so a taken group is the expected case, not an error.
        EPERM is also what a process without CAP_NET_ADMIN gets for every group; that
        ends in the same exhausted error, which says both causes."""
        taken = (errno.EPERM, errno.EBUSY)
        for i in range(attempts):
            group = 1024 + (first + i) % (65535 - 1024)
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                sock.bind((0, 0))
                cmd = _attr(NFULA_CFG_CMD, struct.pack("=B", NFULNL_CFG_CMD_BIND) + b"\0\0\0")
                self._config(sock, group, cmd)
                # Copy the IP + transport headers only; hand each packet over at once.
                mode = _attr(NFULA_CFG_MODE, struct.pack("!IBB", 64, NFULNL_COPY_PACKET, 0))
                qth = _attr(NFULA_CFG_QTHRESH, struct.pack("!I", 1))
                self._config(sock, group, mode + qth)
            except OSError as exc:
                sock.close()
                if exc.errno in taken:
                    continue
                raise
            sock.setblocking(False)
            self.sock, self.group = sock, group
            return group
        raise OSError(
            errno.EBUSY,
            f"no free NFLOG group among the {attempts} from {1024 + first % (65535 - 1024)} "
            "(each is held by another socket, or this process lacks CAP_NET_ADMIN)",
        )

    @staticmethod
    def _config(sock: socket.socket, group: int, attrs: bytes) -> None:
        msg_type = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG
        sock.send(_msg(msg_type, NLM_F_REQUEST | NLM_F_ACK, group, attrs))
        reply = sock.recv(65536)
        _len, mtype = struct.unpack_from("=IH", reply, 0)
        if mtype == NLMSG_ERROR:
            code = struct.unpack_from("=i", reply, 16)[0]
            if code:
                raise OSError(-code, os.strerror(-code))

    def read(self, handler: Callable[[LoggedPacket], None]) -> None:
        """Drain the socket (call when it is readable)."""
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ENOBUFS: the kernel dropped some; go on
                if exc.errno == errno.ENOBUFS:
                    continue
                self.broken = f"reading the NFLOG socket failed: {exc}"
                return
            for pkt in parse_messages(data):
                try:
                    handler(pkt)
                except Exception as exc:  # one bad packet must not stop the reader
                    self.handler_errors += 1
                    if self.handler_errors == 1:
                        log.warning("nflog: handling a packet failed: %r", exc)

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None
