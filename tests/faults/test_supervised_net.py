"""Issue 13 item 3 for the network's own listeners: the DNS responder and the NFLOG
reader are supervised like the seccomp listener. Each fault is injected for real (the
socket goes away under the component), the supervisor sees it within its poll and
restarts the part on the address the nft rules name (the same UDP port, the same NFLOG
group), and it serves again; ``failures()`` (what ``/v1/health`` shows) clears."""

from __future__ import annotations

import asyncio
import errno
import os
import socket

import pytest
from dnslib import DNSRecord

from dsec import supervise
from dsec.net.dns import Answer, DnsServer, Query, Verdict
from dsec.net.nflog import NflogReader
from tests.waiting import until_async

pytestmark = pytest.mark.root


async def _resolve(_source: str, query: Query | None) -> Verdict:
    return Answer(("192.0.2.7",)) if query is not None else Answer()


async def _ask(port: int) -> str | None:
    """One A query for allowed.example to 127.0.0.1:port; the first answer or None."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        await loop.sock_sendto(
            sock, DNSRecord.question("allowed.example").pack(), ("127.0.0.1", port)
        )
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 2)
    except TimeoutError:
        return None
    finally:
        sock.close()
    rr = DNSRecord.parse(data).rr
    return str(rr[0].rdata) if rr else ""


async def test_dns_responder_is_restarted_on_its_port() -> None:
    server = DnsServer(_resolve, lambda ip: ip == "127.0.0.1")
    port = await server.start()
    sup = supervise.Supervisor()
    sup.watch("dns-responder", server.healthy, server.restart, interval=0.1)
    try:
        assert await _ask(port) == "192.0.2.7"
        # The fault: the socket dies under the responder (as a fatal transport error
        # does); nothing answers on the port any more.
        transport = server._transport
        assert transport is not None
        transport.abort()
        await asyncio.sleep(0)
        assert server.healthy() is not None

        # Seen by the supervisor (so by /v1/health) and healed on the same port.
        async def healed() -> bool:
            return server.healthy() is None and await _ask(port) == "192.0.2.7"

        await until_async("the responder healed on its port", healed, 15, interval=0.1)
        assert server.port == port
        await until_async(
            "no failure on record", lambda: not sup.failures(), supervise.STABLE + 10, interval=0.1
        )
        assert sup.components["dns-responder"].restarts >= 1
    finally:
        await sup.close()
        await server.close()


def test_nflog_reader_rebinds_its_group() -> None:
    reader = NflogReader()
    group = reader.bind(os.getpid() % 1000)
    try:
        assert reader.healthy() is None
        # The fault: the socket's descriptor goes away under the reader.
        assert reader.sock is not None
        os.close(reader.sock.detach())
        reader.read(lambda _pkt: None)
        assert reader.healthy() is not None
        reader.rebind()
        assert reader.healthy() is None and reader.group == group
        assert reader.sock is not None and reader.sock.fileno() >= 0
        # The group is really ours again: a second bind of it is refused as busy.
        other = NflogReader()
        with pytest.raises(OSError):
            other.bind(group - 1024, attempts=1)
        other.close()
    finally:
        reader.close()


def test_nflog_bind_skips_a_group_another_platform_holds() -> None:
    """Two platforms' edge-id hashes can land on one group (ci on 173ad01: EPERM at
    start, because the kernel answers a group held by another socket with EPERM, not
    EBUSY). The second platform takes the next free group instead of failing."""
    first = os.getpid() % 1000 + 2000
    holder, second, third = NflogReader(), NflogReader(), NflogReader()
    try:
        held = holder.bind(first)
        got = second.bind(held - 1024)
        assert got != held and got > held
        # Every group in the window held: one typed error that names both causes.
        with pytest.raises(OSError, match=r"among the 1 from .*CAP_NET_ADMIN") as info:
            third.bind(held - 1024, attempts=1)
        assert info.value.errno == errno.EBUSY
    finally:
        for reader in (holder, second, third):
            reader.close()
