"""The edge's DNS responder for sandboxes with network rules, and its upstream client.

Every UDP query a sandbox sends to port 53 (whatever its resolv.conf says) is redirected
here by nftables. A name its rules allow is answered, from the catalog's static
addresses or through an upstream resolver, and the answered IPv4 addresses are added to
that sandbox's allowed set *before* the answer leaves (so the connection that follows
is accepted); any other name gets REFUSED. This is how DNS-based egress filters work:
rules name services, the kernel enforces addresses.

The responder is the agent's first contact with the edge, so it treats each datagram as
hostile: anything that does not parse as one plain query is answered FORMERR or not at
all, without a traceback; what is pending at once is bounded. Upstream, the edge sends
its *own* query (fresh id and port, the lower-cased name, type A, no EDNS options), never
the sandbox's packet, so nothing but the name of an A query ever leaves (see
``dsec.net.dnsguard`` for what bounds the name).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSLabel, DNSRecord
from dnslib.label import DNSLabelError

from dsec.net.dnsguard import name_from_labels

log = logging.getLogger(__name__)

ANSWER_TTL = 30
MAX_DATAGRAM = 4096  # larger than any honest query (EDNS payload sizes top out here)
MAX_PENDING = 1024  # queries in progress per edge; more are dropped unanswered
MAX_ANSWERS = 16  # addresses per answer, after screening
MAX_CNAME_HOPS = 8


@dataclass(frozen=True)
class Query:
    """A question as the responder validated it."""

    name: str  # lower case, plain labels
    qtype: str  # "A", "AAAA", "TXT", ... or the number


@dataclass(frozen=True)
class Refuse:
    """Answer REFUSED."""


@dataclass(frozen=True)
class Answer:
    """Answer NOERROR with these IPv4 addresses (none: an empty answer)."""

    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServFail:
    """Answer SERVFAIL (upstream unreachable, too much pending)."""


Verdict = Refuse | Answer | ServFail
# (source ip, validated query) -> what to answer; None when the query is not valid DNS
# text (a label with other bytes than letters, digits, hyphen, underscore).
Resolver = Callable[[str, Query | None], Awaitable[Verdict]]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.lost(self, exc)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(self.server.tasks) >= MAX_PENDING or len(data) > MAX_DATAGRAM:
            self.server.dropped += 1
            return
        task = asyncio.ensure_future(self.server.answer(data, addr[0]))
        self.server.tasks.add(task)
        task.add_done_callback(lambda t: self._send(t, addr))

    def _send(self, task: asyncio.Future[bytes | None], addr: tuple[str, int]) -> None:
        self.server.tasks.discard(task)
        if task.cancelled() or self.transport is None:
            return
        if (exc := task.exception()) is not None:
            # Once per streak: out of fds, every query fails the same way.
            self.server.failures += 1
            if self.server.failures == 1:
                log.error("DNS responder failed on a query from %s: %r", addr[0], exc)
            return
        if self.server.failures:
            log.warning("DNS responder answers again (%d queries failed)", self.server.failures)
            self.server.failures = 0
        reply = task.result()
        if reply is not None:
            self.transport.sendto(reply, addr)


def parse_query(data: bytes) -> DNSRecord | None:
    """The record of a datagram that is a single standard query, else None."""
    if len(data) > MAX_DATAGRAM:
        return None
    try:
        record = DNSRecord.parse(data)
    except (DNSError, DNSLabelError, UnicodeError, ValueError, IndexError):
        return None
    if record.header.qr or record.header.opcode != 0:
        return None  # a response or a non-QUERY opcode: not ours to answer
    return record


def pack(reply: DNSRecord) -> bytes | None:
    """The wire form of a reply, or None when the echoed question cannot be packed."""
    try:
        return bytes(reply.pack())
    except (DNSError, DNSLabelError, ValueError):
        return None


class DnsServer:
    """One UDP socket per edge (bound on an ephemeral port; nft redirects port 53)."""

    def __init__(self, resolve: Resolver, accept: Callable[[str], bool]) -> None:
        self.resolve = resolve
        self.accept = accept  # does this source address belong to one of our sandboxes?
        self.port = 0
        self.tasks: set[asyncio.Future[bytes | None]] = set()
        self.dropped = 0  # datagrams not answered: oversized or too many pending
        self.failures = 0  # queries in a row whose answer raised
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Protocol | None = None
        self._why_down: str | None = None
        self._restarting: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind (an ephemeral port the first time, the same one on a restart: the nft
        redirect names it) and serve; the port."""
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("0.0.0.0", self.port), family=socket.AF_INET
        )
        self._transport, self._protocol = transport, proto
        self.port = transport.get_extra_info("sockname")[1]
        self._why_down = None
        return self.port

    def lost(self, proto: _Protocol, exc: Exception | None) -> None:
        if proto is self._protocol and self._transport is not None:
            self._transport = None
            self._why_down = f"the DNS socket closed: {exc or 'no error given'}"

    def healthy(self) -> str | None:
        """None while the socket serves; else why not (for the edge's supervisor)."""
        if self._transport is None or self._transport.is_closing():
            return self._why_down or "the DNS socket is closed"
        return None

    def restart(self) -> None:
        """Bind the same port again, in the background (the supervisor polls health)."""
        if self._restarting is not None and not self._restarting.done():
            return
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await self.start()
        except OSError as exc:
            self._why_down = f"cannot bind the DNS port {self.port} again: {exc}"

    async def answer(self, data: bytes, source: str) -> bytes | None:
        """The reply to one datagram from ``source`` (None: send nothing)."""
        if not self.accept(source):
            return None
        query = parse_query(data)
        if query is None:
            return None
        reply = query.reply()
        if len(query.questions) != 1:
            reply.header.rcode = RCODE.FORMERR
            return pack(reply)
        q = query.questions[0]
        name = name_from_labels(q.qname.label)
        qtype = QTYPE.get(q.qtype, str(q.qtype))
        verdict = await self.resolve(source, None if name is None else Query(name, str(qtype)))
        if isinstance(verdict, Refuse):
            reply.header.rcode = RCODE.REFUSED
        elif isinstance(verdict, ServFail):
            reply.header.rcode = RCODE.SERVFAIL
        elif q.qtype == QTYPE.A:
            for ip in verdict.addresses[:MAX_ANSWERS]:
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(ip), ttl=ANSWER_TTL))
        # Other types of an allowed name: an empty answer (IPv4 only, never upstream).
        return pack(reply)

    async def close(self) -> None:
        if self._restarting is not None:
            self._restarting.cancel()
        self._protocol = None  # its connection_lost is ours, not a failure
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        for task in list(self.tasks):
            task.cancel()


# -- upstream -------------------------------------------------------------------------------


class UpstreamError(Exception):
    """The upstream resolver did not give a usable answer."""


@dataclass(frozen=True)
class Resolved:
    """The A records at the end of a name's CNAME chain, as the upstream answered."""

    addresses: tuple[ipaddress.IPv4Address, ...]
    chain: tuple[str, ...] = ()  # the CNAME targets followed, in order
    stray: tuple[ipaddress.IPv4Address, ...] = ()  # A records of other owners: ignored


class UpstreamResolver(Protocol):
    """What the manager looks allowed names up with (tests and benches fake it)."""

    async def resolve(self, name: str) -> Resolved: ...


def default_upstream(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """The host's first IPv4 name server (``DSEC_DNS_UPSTREAM`` overrides it)."""
    with contextlib.suppress(OSError):
        for line in resolv_conf.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    return str(ipaddress.IPv4Address(parts[1])), 53
    return "127.0.0.1", 53


def parse_upstream(text: str) -> tuple[str, int]:
    """``"ip"`` or ``"ip:port"`` (ValueError otherwise)."""
    host, _, port = text.strip().rpartition(":") if ":" in text else (text.strip(), "", "53")
    return str(ipaddress.IPv4Address(host)), int(port)


def follow_chain(reply: DNSRecord, name: str) -> Resolved:
    """The A records of ``name`` in ``reply``, following CNAMEs from ``name`` only: a
    record for any other owner (stuffed in by a hostile zone) is ignored, and so are
    AAAA records (sandboxes have no IPv6)."""
    current = DNSLabel(name)
    chain: list[str] = []
    for _ in range(MAX_CNAME_HOPS):
        target = next(
            (rr.rdata.label for rr in reply.rr if rr.rtype == QTYPE.CNAME and rr.rname == current),
            None,
        )
        if target is None:
            break
        current = target
        chain.append(str(target).rstrip(".").lower())
    owners = {DNSLabel(name), *(DNSLabel(c) for c in chain)}
    found: list[ipaddress.IPv4Address] = []
    stray: list[ipaddress.IPv4Address] = []
    for rr in reply.rr:
        if rr.rtype != QTYPE.A:
            continue
        try:
            ip = ipaddress.IPv4Address(str(rr.rdata))
        except ValueError:
            continue
        bucket = found if rr.rname in owners else stray
        if ip not in bucket:
            bucket.append(ip)
    return Resolved(tuple(found), tuple(chain), tuple(stray))


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self, qid: int, name: str) -> None:
        self.qid, self.name = qid, DNSLabel(name)
        self.done: asyncio.Future[DNSRecord] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.done.done():
            return
        try:
            reply = DNSRecord.parse(data)
        except (DNSError, DNSLabelError, UnicodeError, ValueError, IndexError):
            return  # garbage on our port: keep waiting for the real reply
        if reply.header.id != self.qid or not reply.header.qr or not reply.questions:
            return
        if reply.questions[0].qname != self.name or reply.questions[0].qtype != QTYPE.A:
            return
        self.done.set_result(reply)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(UpstreamError(f"upstream unreachable: {exc}"))


class Upstream:
    """A minimal stub resolver: one A query per call to one recursive server, over UDP
    from a fresh socket (random port and id), answer matched by id and question."""

    def __init__(self, server: tuple[str, int], timeout: float = 2.0, attempts: int = 2) -> None:
        self.server, self.timeout, self.attempts = server, timeout, attempts

    async def resolve(self, name: str) -> Resolved:
        last: Exception = UpstreamError("no attempt")
        for _ in range(self.attempts):
            try:
                return await self._once(name)
            except (TimeoutError, OSError, UpstreamError) as exc:
                last = exc
        raise UpstreamError(f"{name}: {last}")

    async def _once(self, name: str) -> Resolved:
        qid = secrets.randbelow(1 << 16)
        query = DNSRecord.question(name, "A")
        query.header.id = qid
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_datagram_endpoint(
            lambda: _Exchange(qid, name), remote_addr=self.server, family=socket.AF_INET
        )
        try:
            transport.sendto(bytes(query.pack()))
            reply = await asyncio.wait_for(proto.done, self.timeout)
        finally:
            transport.close()
        if reply.header.rcode == RCODE.NXDOMAIN:
            return Resolved(())
        if reply.header.rcode != RCODE.NOERROR:
            raise UpstreamError(f"rcode {RCODE.get(reply.header.rcode)}")
        return follow_chain(reply, name)
