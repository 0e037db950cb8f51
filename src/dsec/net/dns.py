"""The edge's DNS responder for sandboxes with network rules.

Every UDP query a sandbox sends to port 53 (whatever its resolv.conf says) is redirected
here by nftables. A name its rules allow is answered, from the catalog's static
addresses or through the host's resolver, and the answered IPv4 addresses are added to
that sandbox's allowed set *before* the answer leaves (so the connection that follows
is accepted); any other name gets REFUSED. This is how DNS-based egress filters work:
rules name services, the kernel enforces addresses.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import cast

from dnslib import QTYPE, RCODE, RR, A, DNSRecord

log = logging.getLogger(__name__)

# (source ip, query name, query type) -> addresses to answer, or None to refuse.
Resolver = Callable[[str, str, str], Awaitable[list[str] | None]]
ANSWER_TTL = 30


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        task = asyncio.ensure_future(self.server.answer(data, addr[0]))
        self.server.tasks.add(task)
        task.add_done_callback(lambda t: self._send(t, addr))

    def _send(self, task: asyncio.Future[bytes | None], addr: tuple[str, int]) -> None:
        self.server.tasks.discard(task)
        if task.cancelled() or task.exception() is not None or self.transport is None:
            return
        reply = task.result()
        if reply is not None:
            self.transport.sendto(reply, addr)


class DnsServer:
    """One UDP socket per edge (bound on an ephemeral port; nft redirects port 53)."""

    def __init__(self, resolve: Resolver, accept: Callable[[str], bool]) -> None:
        self.resolve = resolve
        self.accept = accept  # does this source address belong to one of our sandboxes?
        self.port = 0
        self.tasks: set[asyncio.Future[bytes | None]] = set()
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("0.0.0.0", 0), family=socket.AF_INET
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        return self.port

    async def answer(self, data: bytes, source: str) -> bytes | None:
        if not self.accept(source):
            return None
        try:
            query = DNSRecord.parse(data)
        except Exception:
            return None
        reply = query.reply()
        if not query.questions:
            reply.header.rcode = RCODE.FORMERR
            return bytes(reply.pack())
        q = query.questions[0]
        qname = str(q.qname).rstrip(".")
        qtype = QTYPE.get(q.qtype, str(q.qtype))
        try:
            addresses = await self.resolve(source, qname, str(qtype))
        except Exception:
            log.exception("DNS resolution of %s failed", qname)
            reply.header.rcode = RCODE.SERVFAIL
            return bytes(reply.pack())
        if addresses is None:
            reply.header.rcode = RCODE.REFUSED
        elif q.qtype == QTYPE.A:
            for ip in addresses:
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(ip), ttl=ANSWER_TTL))
        # AAAA and other types of an allowed name: an empty answer (IPv4 only).
        return bytes(reply.pack())

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        for task in list(self.tasks):
            task.cancel()
