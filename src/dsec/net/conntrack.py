"""Forget the kernel's NAT state that points at a DNS port no longer served.

Sandboxes' DNS (UDP port 53 to their gateway) is redirected by nftables to the edge's
responder, on an ephemeral port that a new edge process chooses again. The redirect is
decided once per conntrack entry, on a flow's first packet; later packets of the same
flow (the same source port) follow the entry, whatever the table says now. A resolver
that keeps its socket (c-ares in Node, long-lived clients) therefore goes on being sent
to the old port after an edge restart and gets "connection refused" -- and since each
retry refreshes the entry's 30 s timeout, it never recovers while it keeps asking.

Deleting those entries makes the next packet of each such flow a new one, which the
current table sends to the current port.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

from pyroute2 import Conntrack
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple


def forget_stale_redirects(
    block: ipaddress.IPv4Network, port: int, *, dport: int = 53, proto: int = socket.IPPROTO_UDP
) -> int:
    """Delete the conntrack entries of flows from ``block`` to port ``dport`` that were
    redirected to any other port than ``port``; how many. Blocking (netlink): run it
    off the event loop. Flows already sent to ``port`` are left alone."""
    stale: list[NFCTAttrTuple] = []
    with Conntrack() as ct:
        for entry in ct.dump_entries(tuple_orig=NFCTAttrTuple(proto=proto, dport=dport)):
            orig, reply = entry.tuple_orig, entry.tuple_reply
            if orig.proto != proto or orig.dport != dport or orig.saddr is None:
                continue
            if ipaddress.IPv4Address(orig.saddr) not in block or reply.sport == port:
                continue
            stale.append(orig)
        for orig in stale:
            try:
                ct.entry("del", tuple_orig=orig)
            except NetlinkError as exc:
                if exc.code != errno.ENOENT:  # else gone meanwhile: nothing to forget
                    raise
    return len(stale)
