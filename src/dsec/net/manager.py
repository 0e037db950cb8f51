"""Egress rules by service: one network per sandbox with rules, enforced by nftables.

Design (numbers from HOST_LIMITS and bench/):

- Sandboxes without ``network_rules`` keep the empty network namespace crun makes:
  nothing here runs for them.
- A sandbox with rules joins a pre-built namespace + veth from a small warm pool (built
  in a worker thread over netlink, see ``dsec.net.netns``), so create pays only one
  libnftables batch (~1 ms) instead of ~18 ms of `ip`/`nft` forks. crun joins the
  namespace through the OCI config's namespace ``path``.
- One nftables table per edge (``inet dsec_<edge>``), so parallel edges never collide.
  Each slot has its own chain ``s<N>`` and set ``a<N>`` of (address . port range); a
  verdict map from the host-side veth name jumps to it. Established flows are accepted
  first, so an update applies to *new* connections at once and leaves open ones alone.
  Anything else is dropped and logged (rate-limited) to an NFLOG group that the edge
  reads into the audit log and events (``dsec.net.nflog``).
- DNS from a sandbox (UDP 53, any server) is redirected to the edge's responder
  (``dsec.net.dns``): allowed names are answered and their addresses added to the set
  before the answer is sent; other names are REFUSED. Upstream answers that point into
  private, loopback, metadata, CGNAT/sandbox or other special ranges are dropped unless
  a static rule of the sandbox covers them, and query names are rate- and
  budget-limited against tunnelling (``dsec.net.dnsguard``); what one sandbox's DNS
  holds here is bounded (``MAX_*`` below).
- The host (every local address: the edge API, other services), the metadata range and
  other sandboxes are not in any set, so they are unreachable unless a rule says so
  ("host", "metadata", or a raw IP rule). IPv6 from sandboxes is dropped.
- Outgoing traffic is masqueraded; the edge turns on ``net.ipv4.ip_forward`` (global).
- Update semantics: ``update(rules)`` REPLACES the rules (it does not merge): the set is
  flushed and refilled in one atomic batch, with the addresses DNS already answered for
  names that stay allowed.
- Recovery: the table lives in the kernel and running sandboxes hold their namespaces,
  so a restarted edge re-adopts them from the records (``adopt``) and rebuilds the
  table atomically from their rules; veths of unknown sandboxes are deleted.
- MicroVMs (``attach(..., vm=True)``) get the same slot with a persistent tap as its
  host-side device instead of netns + veth (``dsec.net.vmtap`` says why); everything
  above is keyed by the device name, so it applies unchanged. Taps are not pooled:
  attaching one costs ~2.5-4 ms on the create path, ~0.5 ms of it on the event loop
  (``tests/test_vm_network.py::test_attach_cost``), next to a boot of seconds; a
  release deletes it explicitly (no namespace takes it along), ~20 ms in the netlink
  thread.
- A VM booting its own OS asks DHCP for its address: the edge answers on each tap with
  the slot's lease and nothing else (``dsec.net.dhcp``); the input chain lets UDP 67 in
  from taps only (set ``vm_taps``), the DHCPDISCOVER from 0.0.0.0 passes the
  reverse-path rule (nft's fib accepts a zero source to the limited broadcast).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from dsec.api.events import AuditKind, EventKind
from dsec.errors import BackendError, InvalidArgument
from dsec.exhaustion import classify
from dsec.net import netns, vmtap
from dsec.net.catalog import Policy, PortRange, Service, compile_rules, load_catalog
from dsec.net.conntrack import forget_stale_redirects
from dsec.net.dhcp import DhcpResponder, Lease
from dsec.net.dns import (
    Answer,
    DnsServer,
    Query,
    Refuse,
    ServFail,
    Upstream,
    UpstreamError,
    UpstreamResolver,
    Verdict,
    default_upstream,
    parse_upstream,
)
from dsec.net.dnsguard import EventLimiter, Reason, Screened, TunnelGuard, blocked, screen
from dsec.net.nflog import LoggedPacket, NflogReader
from dsec.net.nft import Nft, NftError
from dsec.security.audit import AuditSink, NullAudit
from dsec.supervise import Watched

log = logging.getLogger(__name__)

SANDBOX_RANGE = ipaddress.IPv4Network("100.64.0.0/12")  # carrier-grade NAT space
BLOCK_PREFIX = 20  # per edge: 1024 slots of /30
MAX_SLOTS = 1 << (32 - BLOCK_PREFIX - 2)
METADATA_NET = ipaddress.IPv4Network("169.254.0.0/16")
LOG_RATE = "limit rate 20/second burst 40 packets"
# What one sandbox's DNS may hold at the edge, whatever it sends (dsec.net.dnsguard).
MAX_INFLIGHT = 8  # upstream queries at once; more get SERVFAIL
MAX_UPSTREAM_ADDRESSES = 32  # A records of one upstream answer that are looked at
MAX_LEARNED_NAMES = 256
MAX_ADDRESSES_PER_NAME = 32
MAX_LEARNED_ADDRESSES = 1024
MAX_DROPPED_RECORDED = 8
MAX_CNAME_RECORDED = 8
MAX_NAME_RECORDED = 253


@dataclass
class _Sandbox:
    sid: str
    slot: netns.Slot
    policy: Policy
    learned: dict[str, list[str]] = field(default_factory=dict)  # DNS name -> addresses
    learned_count: int = 0
    host_ok: bool = False
    guard: TunnelGuard = field(default_factory=TunnelGuard)
    events: EventLimiter = field(default_factory=EventLimiter)
    inflight: int = 0
    vm: bool = False  # the host-side device is a persistent tap (dsec.net.vmtap)


def _link_exists(name: str) -> bool:
    """Whether the edge's namespace has a device ``name``: one SIOCGIFINDEX ioctl
    (pyroute2's link_lookup dumps every link, ~1 ms with a few hundred sandboxes)."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


def _ports(ranges: PortRange) -> str:
    lo, hi = ranges
    return str(lo) if lo == hi else f"{lo}-{hi}"


class NetworkManager:
    def __init__(
        self,
        *,
        edge_id: str,
        run_dir: Path,
        audit: AuditSink | None = None,
        pool_size: int = 2,
        catalog: dict[str, Service] | None = None,
        upstream: tuple[str, int] | None = None,
    ) -> None:
        self.edge_id = edge_id
        self.run_dir = run_dir
        self.audit: AuditSink = audit or NullAudit()
        self.pool_size = pool_size
        self._catalog = catalog
        names = HostNames.of(edge_id)
        self.prefix = names.veth_prefix  # host-side veth names: <prefix><slot>
        self.table = names.table
        self._hash = names.hash
        self.block: ipaddress.IPv4Network | None = None
        self._nft: Nft | None = None
        self._ipr: IPRoute | None = None
        self._host_ns: int | None = None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="dsec-netlink")
        self._ready: list[netns.Slot] = []
        self._by_sid: dict[str, _Sandbox] = {}
        self._by_ip: dict[str, _Sandbox] = {}
        self._by_ifindex: dict[int, _Sandbox] = {}
        self._adopted: list[tuple[str, dict[str, Any], dict[str, bool]]] = []
        self._chains: set[int] = set()
        self._free: list[int] = []
        self._next = 0
        self._refill: asyncio.Event | None = None
        self._pool_task: asyncio.Task[None] | None = None
        self._dns: DnsServer | None = None
        self._dhcp = DhcpResponder()
        self._upstream: UpstreamResolver = Upstream(upstream or default_upstream())
        self._nflog = NflogReader()
        self._deleting: set[Future[None]] = set()
        self.started = False
        # Told of every denied connection (what it aimed at: "egress", "host",
        # "metadata", "sandbox") and every refused DNS query (why: a dnsguard Reason,
        # "not_allowed", "malformed", "address_limit", "unknown_source"); the edge
        # counts them in its metrics.
        self.on_denied: Callable[[str], None] = lambda target: None
        self.on_dns_refused: Callable[[str], None] = lambda reason: None
        # TCP ports of services the edge itself serves to sandboxes on the host side of
        # their veth (the model gateway, dsec.rollouts.gateway), like the DNS responder:
        # set before ``start``; the service authenticates each caller itself.
        self.service_ports: set[int] = set()

    @classmethod
    def from_env(cls, edge_id: str, run_dir: Path, audit: AuditSink) -> NetworkManager | None:
        """The edge's manager; ``DSEC_NETWORK=0`` turns egress rules off (Unsupported),
        ``DSEC_NETWORK_POOL`` sets the warm pool size (default 2), ``DSEC_DNS_UPSTREAM``
        (``ip[:port]``) the resolver allowed names are looked up at (default: the first
        name server of /etc/resolv.conf)."""
        if os.environ.get("DSEC_NETWORK", "1") == "0":
            return None
        pool = int(os.environ.get("DSEC_NETWORK_POOL", "2"))
        raw = os.environ.get("DSEC_DNS_UPSTREAM")
        upstream = parse_upstream(raw) if raw else None
        return cls(edge_id=edge_id, run_dir=run_dir, audit=audit, pool_size=pool, upstream=upstream)

    # -- configuration ---------------------------------------------------------------------
    @property
    def catalog(self) -> dict[str, Service]:
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    def check(self, rules: dict[str, bool]) -> Policy:
        """Validate rules (InvalidArgument with the reason); no side effect."""
        return compile_rules(rules, self.catalog)

    # -- startup and recovery --------------------------------------------------------------
    def adopt(self, sid: str, net: dict[str, Any], rules: dict[str, bool]) -> None:
        """Remember a running sandbox's network from its record (before ``start``)."""
        self._adopted.append((sid, net, rules))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._nft = Nft()
        self._host_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._ipr = await loop.run_in_executor(self._exec, IPRoute)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.block = await loop.run_in_executor(self._exec, self._choose_block)
        self._nflog.bind(self._hash)
        assert self._nflog.sock is not None
        loop.add_reader(self._nflog.sock.fileno(), self._nflog.read, self._on_packet)
        self._dns = DnsServer(self._resolve, lambda ip: ip in self._by_ip)
        await self._dns.start()
        for sid, net, rules in self._adopted:
            try:
                sb = self._register(sid, self._slot_from(net), compile_rules(rules, self.catalog))
                sb.vm = bool(net.get("tap"))
            except (InvalidArgument, KeyError, ValueError) as exc:
                log.warning("network of %s not re-adopted: %s", sid, exc)
        self._adopted.clear()
        known = {s.slot.ifname for s in self._by_sid.values()}
        links = await loop.run_in_executor(
            self._exec, netns.links_with_prefix, self._ipr, self.prefix
        )
        for name, index in links.items():
            if name in known:
                self._by_ifindex[index] = next(
                    s for s in self._by_sid.values() if s.slot.ifname == name
                )
                self._by_ifindex[index].slot.ifindex = index
            else:  # a leftover of a sandbox no record knows
                await loop.run_in_executor(self._exec, self._del_link, name)
        await asyncio.to_thread(self._nft.run, self._table_text())
        # Flows of a resolver that kept its socket across the restart still go to the
        # last process's DNS port (dsec.net.conntrack): send them to this one.
        try:
            stale = await loop.run_in_executor(
                self._exec, forget_stale_redirects, self.block, self._dns.port
            )
        except (OSError, NetlinkError) as exc:
            log.warning("stale DNS redirects not forgotten (conntrack): %s", exc)
        else:
            if stale:
                log.info("forgot %d DNS flows redirected to a previous edge's port", stale)
        for sb in self._by_sid.values():
            if sb.vm and sb.slot.ifindex:
                try:
                    self._serve_dhcp(sb.slot)
                except OSError as exc:
                    log.warning("no DHCP for %s's tap: %s", sb.sid, exc)
        self._enable_forwarding()
        used = {s.slot.idx for s in self._by_sid.values()}
        self._next = max(used, default=-1) + 1
        self._free = [i for i in range(self._next) if i not in used]
        self._refill = asyncio.Event()
        self._start_pool()
        self.started = True

    def _choose_block(self) -> ipaddress.IPv4Network:
        """A /20 for this edge that no address or route on the host (other than our own
        veths) overlaps; the first choice is a hash of the edge id, stable over restarts."""
        assert self._ipr is not None
        taken: list[ipaddress.IPv4Network] = []
        ours = {idx for name, idx in netns.links_with_prefix(self._ipr, self.prefix).items()}
        for addr in self._ipr.get_addr(family=socket.AF_INET):
            if addr["index"] in ours:
                continue
            taken.append(
                ipaddress.IPv4Network(
                    f"{addr.get_attr('IFA_ADDRESS')}/{addr['prefixlen']}", strict=False
                )
            )
        for route in self._ipr.get_routes(family=socket.AF_INET):
            dst = route.get_attr("RTA_DST")
            if dst and route["dst_len"] and route.get_attr("RTA_OIF") not in ours:
                taken.append(ipaddress.IPv4Network(f"{dst}/{route['dst_len']}", strict=False))
        blocks = list(SANDBOX_RANGE.subnets(new_prefix=BLOCK_PREFIX))
        for i in range(len(blocks)):
            block = blocks[(self._hash + i) % len(blocks)]
            if not any(block.overlaps(t) for t in taken):
                return block
        raise BackendError(f"no free /{BLOCK_PREFIX} in {SANDBOX_RANGE} for sandbox networks")

    def _enable_forwarding(self) -> None:
        with open("/proc/sys/net/ipv4/ip_forward", "r+") as fh:
            if fh.read().strip() != "1":
                fh.seek(0)
                fh.write("1")

    def _slot_for(self, idx: int) -> netns.Slot:
        assert self.block is not None
        base = int(self.block.network_address) + 4 * idx
        return netns.Slot(
            idx=idx,
            ifname=f"{self.prefix}{idx}",
            gw=str(ipaddress.IPv4Address(base + 1)),
            ip=str(ipaddress.IPv4Address(base + 2)),
        )

    def _slot_from(self, net: dict[str, Any]) -> netns.Slot:
        slot = self._slot_for(int(net["slot"]))
        if slot.ip != net["ip"] or slot.ifname != net["ifname"]:
            raise ValueError(f"network block changed ({net['ip']} is not {slot.ip})")
        return slot

    # -- nftables text -----------------------------------------------------------------------
    def _slot_chain(self, idx: int) -> str:
        slot = self._slot_for(idx)
        t = f"inet {self.table}"
        g = self._nflog.group
        match = f"meta l4proto {{ tcp, udp }} ip daddr . th dport @a{idx}"
        return (
            f"add set {t} a{idx} {{ type ipv4_addr . inet_service; flags interval; }}\n"
            f"add chain {t} s{idx}\n"
            f"add rule {t} s{idx} ip saddr != {slot.ip} drop\n"
            f'add rule {t} s{idx} {match} ct state new {LOG_RATE} log group {g} prefix "A"\n'
            f"add rule {t} s{idx} {match} accept\n"
            f'add rule {t} s{idx} {LOG_RATE} log group {g} prefix "D"\n'
            f"add rule {t} s{idx} drop\n"
        )

    def _table_text(self) -> str:
        assert self._dns is not None and self.block is not None
        p, g, t = self.prefix, self._nflog.group, f"inet {self.table}"
        # The edge's own services for sandboxes (open_service_port), like DNS above.
        services = "".join(f"    tcp dport {port} accept\n" for port in sorted(self.service_ports))
        text = (
            f"table {t} {{}}\ndelete table {t}\n"
            f"table {t} {{\n"
            f"  map slots {{ type ifname : verdict; }}\n"
            f"  set host_ok {{ type ifname; }}\n"
            f"  set vm_taps {{ type ifname; }}\n"
            # Reverse-path filter: a sandbox cannot send from an address not routed to it.
            f"  chain rpf {{ type filter hook prerouting priority raw; policy accept;\n"
            f'    iifname "{p}*" fib saddr . iif oif missing drop\n  }}\n'
            f"  chain pre {{ type nat hook prerouting priority dstnat; policy accept;\n"
            f'    iifname "{p}*" udp dport 53 redirect to :{self._dns.port}\n  }}\n'
            f"  chain post {{ type nat hook postrouting priority srcnat; policy accept;\n"
            f'    ip saddr {self.block} oifname != "{p}*" masquerade\n  }}\n'
            f"  chain input {{ type filter hook input priority filter - 5; policy accept;\n"
            f'    iifname "{p}*" jump sbx_in\n  }}\n'
            f"  chain sbx_in {{\n"
            f"    ct state established,related accept\n"
            f"    meta nfproto != ipv4 drop\n"
            f"    udp dport {self._dns.port} accept\n"
            f"{services}"
            # DNS over TCP (resolvers retry with it): refuse at once, it is no host access
            f"    tcp dport 53 reject with tcp reset\n"
            # DHCP from a VM's tap (dsec.net.dhcp answers with the slot's lease only)
            f"    iifname @vm_taps udp dport 67 accept\n"
            f"    iifname @host_ok accept\n"
            f'    {LOG_RATE} log group {g} prefix "H"\n'
            f"    drop\n  }}\n"
            f"  chain forward {{ type filter hook forward priority filter - 5; policy accept;\n"
            f'    iifname "{p}*" jump sbx_fwd\n'
            f'    oifname "{p}*" ct state established,related accept\n'
            f'    oifname "{p}*" drop\n  }}\n'
            f"  chain sbx_fwd {{\n"
            f"    ct state established,related accept\n"
            f"    meta nfproto != ipv4 drop\n"
            f"    iifname vmap @slots\n"
            f"    drop\n  }}\n"
            f"}}\n"
        )
        self._chains = set()
        for sb in self._by_sid.values():
            text += self._slot_chain(sb.slot.idx)
            self._chains.add(sb.slot.idx)
            text += self._activate_text(sb)
        return text

    def _elements(self, sb: _Sandbox) -> list[str]:
        out = [f"{net} . {_ports(p)}" for net, p in sb.policy.static]
        for name, ips in sb.learned.items():
            ports = sb.policy.lookup(name) or ()
            out.extend(f"{ip} . {_ports(p)}" for ip in ips for p in ports)
        return out

    def _activate_text(self, sb: _Sandbox) -> str:
        t, idx = f"inet {self.table}", sb.slot.idx
        text = f'add element {t} slots {{ "{sb.slot.ifname}" : jump s{idx} }}\n'
        if sb.policy.host:
            text += f'add element {t} host_ok {{ "{sb.slot.ifname}" }}\n'
            sb.host_ok = True
        if sb.vm:
            text += f'add element {t} vm_taps {{ "{sb.slot.ifname}" }}\n'
        return text + self._fill_text(sb)

    def _fill_text(self, sb: _Sandbox) -> str:
        elements = self._elements(sb)
        if not elements:
            return ""
        return f"add element inet {self.table} a{sb.slot.idx} {{ {', '.join(elements)} }}\n"

    # -- the pool ----------------------------------------------------------------------------
    async def _pool_loop(self) -> None:
        assert self._refill is not None
        failing = False
        while True:
            await self._refill.wait()
            self._refill.clear()
            while len(self._ready) < self.pool_size:
                try:
                    self._ready.append(await self._build())
                    failing = False
                except Exception as exc:
                    # Once per streak; running out of fds or memory is no bug to trace.
                    if not failing:
                        if classify(exc) is not None:
                            log.warning("building a sandbox network failed: %s", exc)
                        else:
                            log.exception("building a sandbox network failed")
                    failing = True
                    await asyncio.sleep(1)
                    break

    def _claim(self) -> netns.Slot:
        """A slot index whose host-side name is free (no device of that name exists)."""
        # Reuse a freed slot whose device is gone; the veth of a just-ended sandbox may
        # still be going away (the kernel drops it with the namespace): then take a fresh one.
        for idx in [*self._free[:4], None]:
            if idx is None:
                if self._next >= MAX_SLOTS:
                    raise BackendError(f"all {MAX_SLOTS} sandbox networks of this edge are in use")
                idx, self._next = self._next, self._next + 1
            else:
                self._free.remove(idx)
            candidate = self._slot_for(idx)
            if not _link_exists(candidate.ifname):
                return candidate
            self._free.append(idx)
        raise BackendError("no free sandbox network slot")

    async def _chain(self, idx: int) -> None:
        assert self._nft is not None
        if idx not in self._chains:
            await asyncio.to_thread(self._nft.run, self._slot_chain(idx))
            self._chains.add(idx)

    async def _build(self) -> netns.Slot:
        assert self._ipr is not None and self._host_ns is not None
        loop = asyncio.get_running_loop()
        slot = self._claim()
        try:
            await loop.run_in_executor(self._exec, netns.build, slot, self._ipr, self._host_ns)
            await self._chain(slot.idx)
        except BaseException:
            netns.close(slot)
            self._free.append(slot.idx)
            raise
        (self.run_dir / f"{slot.idx}.resolv").write_text(f"nameserver {slot.gw}\n")
        return slot

    async def _build_tap(self) -> netns.Slot:
        assert self._ipr is not None
        loop = asyncio.get_running_loop()
        slot = self._claim()
        try:
            await loop.run_in_executor(self._exec, vmtap.create, self._ipr, slot)
        except BaseException:  # create removes what it made; the name may be another's
            self._free.append(slot.idx)
            raise
        try:
            await self._chain(slot.idx)
        except BaseException:
            await self._delete_tap(slot.ifname)
            self._free.append(slot.idx)
            raise
        return slot

    # -- per sandbox -------------------------------------------------------------------------
    def _serve_dhcp(self, slot: netns.Slot) -> None:
        self._dhcp.add(slot.ifname, Lease(ip=slot.ip, gateway=slot.gw, prefixlen=vmtap.PREFIXLEN))

    def _register(self, sid: str, slot: netns.Slot, policy: Policy) -> _Sandbox:
        sb = _Sandbox(sid=sid, slot=slot, policy=policy)
        self._by_sid[sid] = sb
        self._by_ip[slot.ip] = sb
        if slot.ifindex:
            self._by_ifindex[slot.ifindex] = sb
        return sb

    async def attach(self, sid: str, rules: dict[str, bool], *, vm: bool = False) -> dict[str, Any]:
        """Give ``sid`` a network enforcing ``rules``; returns what its record keeps.

        ``vm``: a microVM's network, a persistent tap with the slot's name and no
        namespace; the record names it, and ``dsec.net.vmtap.attach_vm(record)`` opens
        it for each QEMU launch (create, and every resume)."""
        assert self._nft is not None and self._refill is not None
        policy = self.check(rules)
        if vm:
            slot = await self._build_tap()
        else:
            slot = self._ready.pop(0) if self._ready else await self._build()
            if not self._ready:
                self._refill.set()  # else after the sandbox started: not competing with crun
        sb = self._register(sid, slot, policy)
        sb.vm = vm
        try:
            self._nft.run(self._activate_text(sb))
            if vm:
                self._serve_dhcp(slot)
        except (NftError, OSError):
            self.release(sid)
            raise
        if vm:
            return {
                "slot": slot.idx,
                "ip": slot.ip,
                "ifname": slot.ifname,
                "tap": True,
                "gateway": slot.gw,
                "mac": vmtap.guest_mac(self.prefix, slot.idx),
            }
        return {
            "slot": slot.idx,
            "ip": slot.ip,
            "ifname": slot.ifname,
            "netns": slot.netns_path(),
            "resolv_conf": str(self.run_dir / f"{slot.idx}.resolv"),
        }

    def open_service_port(self, port: int) -> None:
        """Let every sandbox with rules reach TCP ``port`` on the host side of its veth
        (a service of the edge that authenticates its callers itself)."""
        if port in self.service_ports:
            return
        self.service_ports.add(port)
        if self.started and self._nft is not None:
            self._nft.run(f"insert rule inet {self.table} sbx_in tcp dport {port} accept\n")

    def address_of(self, sid: str) -> tuple[str, str] | None:
        """``(sandbox address, host-side gateway address)`` of a sandbox with rules: where
        a service in ``service_ports`` is reached from it, and whom a caller must be."""
        sb = self._by_sid.get(sid)
        return None if sb is None else (sb.slot.ip, sb.slot.gw)

    def joined(self, sid: str) -> None:
        """The sandbox holds its namespace now: drop our fd, so it dies with the sandbox."""
        sb = self._by_sid.get(sid)
        if sb is not None:
            netns.close(sb.slot)
        if self._refill is not None:
            self._refill.set()

    async def update(self, sid: str, rules: dict[str, bool]) -> None:
        """Replace (not merge) the rules of a running sandbox, atomically."""
        assert self._nft is not None
        sb = self._by_sid.get(sid)
        if sb is None:
            raise InvalidArgument(
                f"sandbox {sid} was created without network_rules, so its network cannot "
                "change; create it with rules (e.g. {'pypi': False}) to update them later"
            )
        policy = self.check(rules)
        t = f"inet {self.table}"
        old_policy, sb.policy = sb.policy, policy
        sb.learned = {n: ips for n, ips in sb.learned.items() if policy.lookup(n) is not None}
        sb.learned_count = sum(len(ips) for ips in sb.learned.values())
        sb.guard.forget_zones(policy.suffixes)
        text = f"flush set {t} a{sb.slot.idx}\n" + self._fill_text(sb)
        if policy.host and not sb.host_ok:
            text += f'add element {t} host_ok {{ "{sb.slot.ifname}" }}\n'
        elif sb.host_ok and not policy.host:
            text += f'delete element {t} host_ok {{ "{sb.slot.ifname}" }}\n'
        try:
            self._nft.run(text)
        except NftError:
            sb.policy = old_policy
            raise
        sb.host_ok = policy.host

    def release(self, sid: str) -> None:
        """Forget ``sid``'s network (the kernel removes the netns and veth with it)."""
        sb = self._by_sid.pop(sid, None)
        if sb is None:
            return
        self._by_ip.pop(sb.slot.ip, None)
        self._by_ifindex.pop(sb.slot.ifindex, None)
        netns.close(sb.slot)
        if sb.vm:  # no namespace takes the tap along: delete it, off the event loop
            self._spawn_delete(sb.slot.ifname)
        t = f"inet {self.table}"
        text = f"flush set {t} a{sb.slot.idx}\n"
        text += f'delete element {t} slots {{ "{sb.slot.ifname}" }}\n'
        if sb.host_ok:
            text += f'delete element {t} host_ok {{ "{sb.slot.ifname}" }}\n'
        if sb.vm:
            text += f'delete element {t} vm_taps {{ "{sb.slot.ifname}" }}\n'
            self._dhcp.remove(sb.slot.ifname)
        if self._nft is not None:
            try:
                self._nft.run(text)
            except NftError as exc:
                log.warning("network rules of %s not removed: %s", sid, exc)
        self._free.append(sb.slot.idx)

    # -- DNS and logged packets ----------------------------------------------------------------
    async def _resolve(self, source: str, query: Query | None) -> Verdict:
        """What one sandbox's query gets: every check runs before anything goes upstream
        or into the allow set (``dsec.net.dnsguard``)."""
        sb = self._by_ip.get(source)
        if sb is None:
            return self._refuse("unknown_source")
        if (reason := sb.guard.rate()) is not None:
            self._tunnel_event(sb, reason, None)  # no audit row: the bucket bounds those
            return self._refuse(reason)
        if query is None:
            self._tunnel_event(sb, sb.guard.malformed(), None)
            self.audit.record(sb.sid, AuditKind.NETWORK, "dns_refused", reason="malformed")
            return self._refuse("malformed")
        name, qtype = query.name, query.qtype
        found = sb.policy.match(name)
        if found is None:
            self.audit.record(sb.sid, AuditKind.NETWORK, "dns_refused", name=name, qtype=qtype)
            return self._refuse("not_allowed")
        ports, zone = found
        if (reason := sb.guard.name(name, zone)) is not None:
            self._tunnel_event(sb, reason, zone, name)
            self.audit.record(
                sb.sid, AuditKind.NETWORK, "dns_refused", name=name, qtype=qtype, reason=reason
            )
            return self._refuse(reason)
        if qtype != "A":
            return Answer()  # only A queries ever go upstream
        static = sb.policy.static_answers.get(name)
        if static:  # operator configuration: trusted (dsec.net.catalog)
            return self._learn(sb, name, ports, [ipaddress.IPv4Address(ip) for ip in static])
        if sb.inflight >= MAX_INFLIGHT:
            return ServFail()
        sb.inflight += 1
        try:
            resolved = await self._upstream.resolve(name)
        except UpstreamError as exc:
            log.warning("DNS upstream for %s: %s", name, exc)
            return ServFail()
        finally:
            sb.inflight -= 1
        screened = self._screen(sb, resolved.addresses)
        # Records for other owners are never answered; the blocked ones still tell.
        dropped = [*screened.dropped, *(ip for ip in resolved.stray if blocked(ip))]
        if dropped:
            self._rebinding(sb, name, zone, resolved.chain, dropped)
        return self._learn(sb, name, ports, screened.kept, screened.covered, resolved.chain)

    def _refuse(self, reason: str) -> Refuse:
        """A REFUSED answer, counted by ``reason`` (a bounded set: see on_dns_refused)."""
        self.on_dns_refused(str(reason))
        return Refuse()

    def _screen(self, sb: _Sandbox, addresses: Sequence[ipaddress.IPv4Address]) -> Screened:
        return screen(addresses[:MAX_UPSTREAM_ADDRESSES], sb.policy.exempt)

    def _learn(
        self,
        sb: _Sandbox,
        name: str,
        ports: tuple[PortRange, ...],
        kept: Sequence[ipaddress.IPv4Address],
        covered: Sequence[ipaddress.IPv4Address] = (),
        chain: Sequence[str] = (),
    ) -> Verdict:
        """Add the kept addresses to the set (bounded per sandbox), then answer them and
        the ones a static rule already covers."""
        ips = [str(ip) for ip in kept]
        known = sb.learned.get(name, [])
        new = [ip for ip in ips if ip not in known]
        if new and (
            len(known) + len(new) > MAX_ADDRESSES_PER_NAME
            or (name not in sb.learned and len(sb.learned) >= MAX_LEARNED_NAMES)
            or sb.learned_count + len(new) > MAX_LEARNED_ADDRESSES
        ):
            self.audit.record(
                sb.sid, AuditKind.NETWORK, "dns_refused", name=name, reason="address_limit"
            )
            self._limited_event(sb, EventKind.RESOURCE_LIMIT, "dns_addresses", limit="dns")
            return self._refuse("address_limit")
        if new and self._by_sid.get(sb.sid) is sb:  # (not released while upstream ran)
            sb.learned.setdefault(name, []).extend(new)
            sb.learned_count += len(new)
            self._allow(sb, new, ports)
        answer = [*ips, *(str(ip) for ip in covered)]
        detail: dict[str, Any] = {"name": name, "addresses": answer}
        if chain:
            detail["cname"] = list(chain[:MAX_CNAME_RECORDED])
        self.audit.record(sb.sid, AuditKind.NETWORK, "dns_answered", **detail)
        return Answer(tuple(answer))

    def _allow(self, sb: _Sandbox, ips: Sequence[str], ports: tuple[PortRange, ...]) -> None:
        """Put (address . port range) elements into the sandbox's set."""
        if self._nft is None:
            return
        for ip in ips:
            elements = ", ".join(f"{ip} . {_ports(p)}" for p in ports)
            with contextlib.suppress(NftError):  # already covered by a CIDR rule
                self._nft.run(f"add element inet {self.table} a{sb.slot.idx} {{ {elements} }}")

    def _rebinding(
        self,
        sb: _Sandbox,
        name: str,
        zone: str | None,
        chain: Sequence[str],
        dropped: Sequence[ipaddress.IPv4Address],
    ) -> None:
        """Record answers dropped as rebinding: an audit row each time, an event per
        allowed name or zone at most every few seconds (the count rides along)."""
        listed = [str(ip) for ip in dropped[:MAX_DROPPED_RECORDED]]
        detail: dict[str, Any] = {"name": name, "dropped": listed, "dropped_count": len(dropped)}
        if chain:
            detail["cname"] = list(chain[:MAX_CNAME_RECORDED])
        self.audit.record(sb.sid, AuditKind.NETWORK, "dns_rebinding_dropped", **detail)
        self._limited_event(sb, EventKind.DNS_REBINDING, f"rebind:{zone or name}", **detail)

    def _tunnel_event(self, sb: _Sandbox, reason: Reason, zone: str | None, name: str = "") -> None:
        detail: dict[str, Any] = {"reason": str(reason), "refused": sb.guard.refused[reason]}
        if zone is not None:
            detail["zone"] = zone
        if name:
            detail["name"] = name[:MAX_NAME_RECORDED]
        key = f"tunnel:{reason}:{zone or ''}"
        self._limited_event(sb, EventKind.DNS_TUNNEL_SUSPECTED, key, **detail)

    def _limited_event(self, sb: _Sandbox, kind: EventKind, key: str, **detail: Any) -> None:
        emit, held = sb.events.allow(key)
        if emit:
            self.audit.event(sb.sid, kind, suppressed=held, total=sb.events.total[key], **detail)

    def _classify(self, dst: str) -> str | None:
        addr = ipaddress.IPv4Address(dst)
        if addr in METADATA_NET:
            return "metadata"
        if addr in SANDBOX_RANGE:
            return "sandbox"
        return None

    def _on_packet(self, pkt: LoggedPacket) -> None:
        sb = self._by_ifindex.get(pkt.indev) or self._by_ip.get(pkt.src)
        if sb is None:
            return
        proto = {6: "tcp", 17: "udp", 1: "icmp"}.get(pkt.proto, str(pkt.proto))
        detail: dict[str, Any] = {"dst": pkt.dst, "port": pkt.dport, "proto": proto}
        if pkt.prefix == "A":
            self.audit.record(sb.sid, AuditKind.NETWORK, "connect_allowed", **detail)
            return
        target = "host" if pkt.prefix == "H" else self._classify(pkt.dst)
        self.on_denied(target or "egress")
        self.audit.record(sb.sid, AuditKind.NETWORK, "connect_denied", **detail)
        if target is not None:
            self.audit.event(sb.sid, EventKind.HOST_ACCESS, target=target, **detail)
        else:
            self.audit.event(sb.sid, EventKind.DENIED_CONNECTION, **detail)

    # -- supervision (dsec.supervise) ---------------------------------------------------
    def supervised(self) -> list[Watched]:
        """The network's long-running parts, for the edge's supervisor: each says why it
        is down and restarts itself (DNS on its port, NFLOG on its group, the pool)."""
        if not self.started:
            return []
        assert self._dns is not None
        return [
            ("dns-responder", self._dns.healthy, self._dns.restart),
            ("nflog-reader", self._nflog.healthy, self._restart_nflog),
            ("network-pool", self._pool_health, self._start_pool),
        ]

    def _restart_nflog(self) -> None:
        loop = asyncio.get_running_loop()
        if self._nflog.sock is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(self._nflog.sock.fileno())
        self._nflog.rebind()
        assert self._nflog.sock is not None
        loop.add_reader(self._nflog.sock.fileno(), self._nflog.read, self._on_packet)

    def _pool_health(self) -> str | None:
        task = self._pool_task
        if task is None or not task.done():
            return None
        exc = None if task.cancelled() else task.exception()
        return f"the warm network pool stopped: {exc!r}"

    def _start_pool(self) -> None:
        self._refill = self._refill or asyncio.Event()
        self._refill.set()
        self._pool_task = asyncio.create_task(self._pool_loop(), name="dsec-net-pool")

    # -- shutdown ----------------------------------------------------------------------------
    def _del_link(self, name: str) -> None:
        assert self._ipr is not None
        with contextlib.suppress(Exception):
            self._ipr.link("del", ifname=name)

    async def _delete_tap(self, name: str) -> None:
        assert self._ipr is not None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._exec, vmtap.detach_vm, self._ipr, {"ifname": name})

    def _spawn_delete(self, name: str) -> None:
        """Delete a tap in the netlink thread (~20 ms of the kernel's device unregister,
        off the event loop); a later ``_claim`` skips the name until it is gone."""
        if self._ipr is None:
            return
        fut = self._exec.submit(vmtap.detach_vm, self._ipr, {"ifname": name})
        self._deleting.add(fut)
        fut.add_done_callback(self._deleting.discard)

    async def settled(self) -> None:
        """Wait until the taps of released microVMs are deleted (tests, shutdown)."""
        pending = [asyncio.wrap_future(f) for f in list(self._deleting)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def close(self, *, keep_rules: bool = False) -> None:
        """Stop the pool and the readers; unless ``keep_rules`` (sandboxes go on running
        for the next edge process), remove the table and every veth of this edge."""
        loop = asyncio.get_running_loop()
        if self._pool_task is not None:
            self._pool_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pool_task
            self._pool_task = None
        for slot in self._ready:
            netns.close(slot)
        self._ready.clear()
        if self._nflog.sock is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(self._nflog.sock.fileno())
        self._nflog.close()
        if self._dns is not None:
            await self._dns.close()
        self._dhcp.close()
        if self._ipr is not None:
            if not keep_rules:
                for sb in list(self._by_sid.values()):
                    self.release(sb.sid)
                await self.settled()
                if self._nft is not None:
                    with contextlib.suppress(NftError):
                        self._nft.run(f"delete table inet {self.table}")
                # Dropped namespaces take their veths along asynchronously; wait a little,
                # then delete what is left so that nothing outlives the edge.
                for _ in range(50):
                    links = await loop.run_in_executor(
                        self._exec, netns.links_with_prefix, self._ipr, self.prefix
                    )
                    if not links:
                        break
                    await asyncio.sleep(0.05)
                for name in links:
                    await loop.run_in_executor(self._exec, self._del_link, name)
                for f in self.run_dir.glob("*.resolv"):
                    f.unlink(missing_ok=True)
            await loop.run_in_executor(self._exec, self._ipr.close)
            self._ipr = None
        if self._nft is not None:
            self._nft.close()
            self._nft = None
        if self._host_ns is not None:
            os.close(self._host_ns)
            self._host_ns = None
        self._exec.shutdown(wait=True)
        self.started = False


@dataclass(frozen=True)
class HostNames:
    """What an edge's network is called on the host, from its id alone: its nft table
    and the prefix of its veths (also for cleaning up after an edge that is gone)."""

    table: str
    veth_prefix: str
    hash: int  # spreads edges' address blocks

    @classmethod
    def of(cls, edge_id: str) -> HostNames:
        digest = hashlib.sha1(edge_id.encode()).hexdigest()
        return cls(
            table="dsec_" + "".join(c if c.isalnum() else "_" for c in edge_id),
            veth_prefix="d" + digest[:5],
            hash=int(digest[5:13], 16),
        )


def host_leftovers(edge_id: str) -> list[str]:
    """What a stopped edge must not leave behind: its nft table and veths (tests)."""
    probe = HostNames.of(edge_id)
    found: list[str] = []
    nft = Nft()
    try:
        with contextlib.suppress(NftError):
            nft.run(f"list table inet {probe.table}")
            found.append(f"nft table inet {probe.table}")
    finally:
        nft.close()
    found.extend(f"veth {name}" for name in _in_thread(netns.links_with_prefix, probe.veth_prefix))
    return found


def _in_thread(fn: Any, *args: Any) -> Any:
    """Run ``fn(IPRoute(), *args)`` in a fresh thread: pyroute2's sync API runs its own
    event loop, which fails inside a running one (async callers, tests)."""
    with ThreadPoolExecutor(1) as pool:

        def run() -> Any:
            with IPRoute() as ipr:
                return fn(ipr, *args)

        return pool.submit(run).result()


def remove_leftovers(edge_id: str) -> None:
    """Delete a dead edge's nft table and veths (tests clean up after a failure)."""
    probe = HostNames.of(edge_id)
    nft = Nft()
    try:
        with contextlib.suppress(NftError):
            nft.run(f"delete table inet {probe.table}")
    finally:
        nft.close()

    def delete(ipr: IPRoute, prefix: str) -> None:
        for name in netns.links_with_prefix(ipr, prefix):
            with contextlib.suppress(Exception):
                ipr.link("del", ifname=name)

    _in_thread(delete, probe.veth_prefix)
