"""Egress rules by service, for real: netns + veth + nftables + the edge's DNS responder.

Nothing leaves this machine: fake "pypi" and "npm" HTTP services run in their own
network namespaces (198.18.0.0/15, the benchmarking range), and a test catalog maps the
service names to them with static DNS answers.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import ipaddress
import json
import logging
import os
import secrets
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from dsec import DSecClient, DSecContainerRunArgs
from dsec.api.events import AuditKind, EventKind
from dsec.errors import InvalidArgument
from dsec.net.catalog import DEFAULT_SERVICES, Service, compile_rules, load_catalog
from dsec.net.dns import Resolved, Upstream
from dsec.net.dnsguard import EventLimiter, Limits, Reason, TunnelGuard, looks_like_data, screen
from tests.conftest import PlatformProcess, platform_process
from tests.fakenet import (
    FakeService,
    StaticUpstream,
    dnsq_program,
    fake_resolver,
    offline_dns,
    pypi_and_npm,
)
from tests.waiting import until_async

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

GET = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2"


@contextlib.contextmanager
def host_service() -> Iterator[int]:
    """An HTTP service of the host on 0.0.0.0 (answers ``host-ok``); yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"host-ok")

        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.ThreadingTCPServer(("0.0.0.0", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Net:
    platform: PlatformProcess
    pypi: FakeService
    npm: FakeService
    image: str


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with (
        pypi_and_npm() as (pypi, npm),
        tempfile.TemporaryDirectory(prefix="dsec-netcat-") as tmp,
    ):
        catalog = Path(tmp) / "catalog.json"
        catalog.write_text(
            json.dumps(
                {
                    "services": {
                        "pypi": {
                            "hosts": ["pypi.org", "files.pythonhosted.org"],
                            "ports": [80],
                            "addresses": {
                                "pypi.org": [pypi.ip],
                                "files.pythonhosted.org": [pypi.ip],
                            },
                        },
                        "npm": {
                            "hosts": ["registry.npmjs.org"],
                            "ports": [80],
                            "addresses": {"registry.npmjs.org": [npm.ip]},
                        },
                    }
                }
            )
        )
        with platform_process(DSEC_NETWORK_CATALOG=str(catalog)) as plat:
            from dsec import DSecSyncClient

            with DSecSyncClient(plat.url, plat.api_key) as c:
                c.build_image("busybox")
            yield Net(plat, pypi, npm, "busybox:latest")


@pytest.fixture
async def nclient(net: Net) -> AsyncIterator[DSecClient]:
    c = DSecClient(net.platform.url, net.platform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


def spec(net: Net, rules: dict[str, bool], job: str | None = None) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image=net.image, network_rules=rules, memory_limit_mb=64, job_id=job
    )


async def fetch(sb: object, url: str) -> tuple[int, str]:
    """GET ``url`` with busybox nc (the static busybox's wget crashes without glibc's NSS
    modules in the image); a host name is resolved by the sandbox's DNS first. Returns
    (exit code, body)."""
    hostport, _, path = url.split("//", 1)[1].partition("/")
    host, _, port = hostport.partition(":")
    get = f"printf 'GET /{path} HTTP/1.0\\r\\n\\r\\n' | nc -w 2"
    if host[0].isdigit():
        cmd = f"{get} {host} {port or 80}"
    else:
        cmd = (
            f"ip=$(nslookup {host} | awk '/^Address/ {{a=$NF}} END {{print a}}') && "
            f'[ -n "$ip" ] && {get} "$ip" {port or 80}'
        )
    res = await sb.run_shell(cmd, timeout=20)  # type: ignore[attr-defined]
    head, sep, body = res.stdout.partition("\r\n\r\n")
    if res.exit_code != 0 or not sep or " 200 " not in head.split("\r\n")[0]:
        return res.exit_code or 1, res.stdout + res.stderr
    return 0, body.strip()


def test_rules_are_validated_against_the_catalog() -> None:
    catalog = load_catalog(None)
    policy = compile_rules({"pypi": True, "npm": False, "10.0.0.0/8:80,443": True}, catalog)
    assert policy.lookup("pypi.org") == ((80, 80), (443, 443))
    assert policy.lookup("files.pythonhosted.org") is not None
    assert policy.lookup("registry.npmjs.org") is None
    assert ("10.0.0.0/8", (443, 443)) in policy.static
    gh = compile_rules({"github": True}, catalog)
    assert gh.lookup("objects.githubusercontent.com") and gh.lookup("x.githubusercontent.com")
    for bad in ("nosuchservice", "10.0.0.1/8", "10.0.0.300", "10.0.0.1:0", "10.0.0.1:9-2"):
        with pytest.raises(InvalidArgument):
            compile_rules({bad: True}, catalog)


async def test_allowed_service_by_name_denied_one_fails(net: Net, nclient: DSecClient) -> None:
    job = "netjob-" + secrets.token_hex(4)
    async with await nclient.run_container(
        spec(net, {"pypi": True, "npm": False}, job), timeout=60
    ) as sb:
        assert await fetch(sb, "http://pypi.org/") == (0, "fake-pypi")
        assert await fetch(sb, "http://files.pythonhosted.org/") == (0, "fake-pypi")
        # The denied service: its name does not resolve, and its address is dropped.
        res = await sb.run_shell("nslookup registry.npmjs.org", timeout=20)
        assert res.exit_code != 0 and "REFUSED" in (res.stdout + res.stderr).upper()
        code, _ = await fetch(sb, f"http://{net.npm.ip}/")
        assert code != 0
        # Unknown names are refused too; loopback always works.
        res = await sb.run_shell("nslookup example.com", timeout=20)
        assert res.exit_code != 0
        res = await sb.run_shell(
            "mkdir -p /tmp/w && echo lo-ok > /tmp/w/index.html && "
            "httpd -p 127.0.0.1:8080 -h /tmp/w",
            timeout=20,
        )
        assert await fetch(sb, "http://127.0.0.1:8080/index.html") == (0, "lo-ok")

        async def denied_event() -> bool:
            evs = await nclient.events(job=job, kinds=[EventKind.DENIED_CONNECTION])
            return any(e.detail.get("dst") == net.npm.ip for e in evs)

        await until_async("a denied_connection event for the npm address", denied_event, 3.0)
        rows = await nclient.audit(job=job, kinds=[AuditKind.NETWORK], limit=10_000)
        actions = {(r.action, r.detail.get("name") or r.detail.get("dst")) for r in rows}
        assert ("dns_answered", "pypi.org") in actions
        assert ("dns_refused", "registry.npmjs.org") in actions
        assert ("connect_denied", net.npm.ip) in actions


async def test_update_network_replaces_rules(net: Net, nclient: DSecClient) -> None:
    """Setup phase may reach pypi, solve phase nothing; then npm only (replace, not merge)."""
    async with await nclient.run_container(spec(net, {"pypi": True}), timeout=60) as sb:
        assert await fetch(sb, "http://pypi.org/") == (0, "fake-pypi")
        durations = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert await sb.update_network({}) == {}
            durations.append(time.perf_counter() - t0)
            await sb.update_network({"pypi": True})
        print(f"update_network round trip p50 {sorted(durations)[2] * 1000:.2f} ms")
        assert sorted(durations)[2] < 0.1
        await sb.update_network({})
        code, _ = await fetch(sb, "http://pypi.org/")
        assert code != 0, "pypi still reachable after the rules were replaced by {}"
        assert await sb.update_network({"npm": True}) == {"npm": True}
        assert await fetch(sb, "http://registry.npmjs.org/") == (0, "fake-npm")
        code, _ = await fetch(sb, "http://pypi.org/")
        assert code != 0, "update merged instead of replacing"
        # Raw IP rules work by address, with ports.
        await sb.update_network({f"{net.pypi.ip}:80": True})
        assert await fetch(sb, f"http://{net.pypi.ip}/") == (0, "fake-pypi")
        with pytest.raises(InvalidArgument):
            await sb.update_network({"nosuchservice": True})
        with pytest.raises(InvalidArgument):
            await sb.update_network({"10.0.0.1/8": True})


async def test_host_metadata_and_other_sandboxes_unreachable(net: Net, nclient: DSecClient) -> None:
    job = "netjob-" + secrets.token_hex(4)
    port = net.platform.port
    async with (
        await nclient.run_container(spec(net, {"pypi": True}, job), timeout=60) as a,
        await nclient.run_container(spec(net, {"pypi": False}), timeout=60) as b,
    ):
        gw = (await a.run_shell("ip route | awk '/default/ {print $3}'")).stdout.strip()
        b_ip = (
            await b.run_shell(
                "ip -4 addr show eth0 | awk '/inet / {split($2,a,\"/\"); print a[1]}'"
            )
        ).stdout.strip()
        assert gw and b_ip
        await b.run_shell(
            "mkdir -p /tmp/w && echo b > /tmp/w/index.html && httpd -p 8080 -h /tmp/w"
        )
        assert (await fetch(a, f"http://{gw}:{port}/v1/health"))[0] != 0  # edge API via host
        assert (await fetch(a, "http://169.254.169.254/"))[0] != 0  # metadata
        assert (await fetch(a, f"http://{b_ip}:8080/index.html"))[0] != 0  # another sandbox
        assert (await fetch(a, "http://pypi.org/"))[1] == "fake-pypi"

        async def host_events() -> bool:
            evs = await nclient.events(job=job, kinds=[EventKind.HOST_ACCESS])
            return {"host", "metadata", "sandbox"} <= {e.detail.get("target") for e in evs}

        await until_async("host_access events for host, metadata and sandbox", host_events, 3.0)
        with host_service() as host_port:  # a host service listening on every address
            assert (await fetch(a, f"http://{gw}:{host_port}/"))[0] != 0
            # Explicitly allowed, the other sandbox and the host are reachable.
            await a.update_network({f"{b_ip}:8080": True, "host": True})
            assert await fetch(a, f"http://{b_ip}:8080/") == (0, "b")
            assert await fetch(a, f"http://{gw}:{host_port}/") == (0, "host-ok")


async def test_sandbox_without_rules_has_loopback_only(net: Net, nclient: DSecClient) -> None:
    async with await nclient.run_container(
        DSecContainerRunArgs(container_image=net.image, memory_limit_mb=64), timeout=60
    ) as sb:
        links = (await sb.run_shell("ls /sys/class/net")).stdout.split()
        assert links == ["lo"]
        with pytest.raises(InvalidArgument, match="without network_rules"):
            await sb.update_network({"pypi": True})


def test_rules_survive_an_edge_restart(net: Net) -> None:
    """SIGKILL the platform: the sandbox keeps its network and rules; the new edge
    rebuilds its table and DNS, and a clean stop leaves nothing behind."""
    from dsec import DSecSyncClient

    plat = net.platform
    with DSecSyncClient(plat.url, plat.api_key) as c:
        sb = c.run_container(spec(net, {"npm": True}), timeout=60)
        res = sb.run_shell(f"nslookup registry.npmjs.org && {GET} {net.npm.ip} 80")
        assert res.stdout.endswith("fake-npm"), res.stdout + res.stderr
    plat.kill()
    plat.start()
    with DSecSyncClient(plat.url, plat.api_key) as c:
        sb = c.get(sb.id)
        assert sb.info.state.value == "running"
        # The address learnt from DNS before the restart is gone with the old table.
        res = sb.run_shell(f"nslookup registry.npmjs.org && {GET} {net.npm.ip} 80", timeout=20)
        assert res.stdout.endswith("fake-npm"), res.stdout + res.stderr
        res = sb.run_shell(f"{GET} {net.pypi.ip} 80", timeout=20)
        assert "fake-pypi" not in res.stdout
        sb.update_network({})
        res = sb.run_shell(f"{GET} {net.npm.ip} 80", timeout=20)
        assert "fake-npm" not in res.stdout
        sb.stop()


def test_a_resolver_that_keeps_its_socket_is_answered_after_an_edge_restart(
    net: Net,
) -> None:
    """The kernel's NAT entry of a DNS flow still names the last process's port after a
    restart; a resolver that keeps its source port (c-ares in Node, long-lived clients)
    must reach the new responder, not be refused for as long as it keeps asking
    (dsec.net.conntrack)."""
    from dsec import DSecSyncClient

    plat = net.platform
    answered = "sent=1 noerror=1 refused=0 servfail=0 formerr=0 other=0 timeout=0 answers=1"
    with DSecSyncClient(plat.url, plat.api_key) as c:
        sb = c.run_container(spec(net, {"npm": True}), timeout=60)
        try:
            sb.write_file("/dnsq", dnsq_program(), mode=0o755)
            gw = sb.run_shell("ip route | awk '/default/ {print $3}'").stdout.strip()
            ask = f"echo registry.npmjs.org | /dnsq -p 40053 {gw} 1 -"
            assert sb.run_shell(ask).stdout.strip() == answered
            plat.kill()
            plat.start()
            sb = c.get(sb.id)
            for _ in range(2):  # the first answer, and the flow it made is the new one
                res = sb.run_shell(ask, timeout=20)
                assert res.stdout.strip() == answered, res.stdout + res.stderr
            other = sb.run_shell(ask.replace("40053", "40054"), timeout=20)
            assert other.stdout.strip() == answered
        finally:
            sb.stop()


def test_cli_create_and_replace_rules(net: Net) -> None:
    env = {**os.environ, "DSEC_URL": net.platform.url, "DSEC_API_KEY": net.platform.api_key}
    dsec = [sys.executable, "-m", "dsec.cli.main"]

    def run(*args: str) -> str:
        p = subprocess.run([*dsec, *args], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    sid = run("sandbox", "create", "--image", net.image, "--allow", "pypi", "--deny", "npm")
    try:
        assert run("sandbox", "network", sid, "--allow", "npm") == "allowed: npm"
        assert json.loads(run("sandbox", "network", sid, "--json")) == {"network_rules": {}}
        bad = subprocess.run(
            [*dsec, "sandbox", "network", sid, "--allow", "nosuchservice"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "nosuchservice" in bad.stderr
    finally:
        run("sandbox", "rm", sid)


# ---- DNS rebinding and tunnelling, in-process (dsec.net.dnsguard) -------------------------

EVIL = Service(name="evil", hosts=("*.evil.test", "exact.evil.test"), ports=((80, 80),))


def ip4(*texts: str) -> tuple[ipaddress.IPv4Address, ...]:
    return tuple(ipaddress.IPv4Address(t) for t in texts)


def answers(reply: DNSRecord | None) -> list[str]:
    assert reply is not None
    return [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]


def rcode(reply: DNSRecord | None) -> str:
    assert reply is not None
    return str(RCODE.get(reply.header.rcode))


def test_screen_drops_every_special_range_and_keeps_public_ones() -> None:
    bad = ("169.254.169.254", "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1",
           "100.64.0.6", "100.127.255.254", "0.0.0.0", "224.0.0.251", "255.255.255.255",
           "198.18.0.2", "192.0.2.1", "240.0.0.1")  # fmt: skip
    good = ("93.184.216.34", "151.101.0.223", "140.82.112.3")
    out = screen(ip4(*bad, *good), [])
    assert [str(ip) for ip in out.kept] == list(good)
    assert [str(ip) for ip in out.dropped] == list(bad) and not out.covered
    # A static network of the sandbox (raw IP rule, service CIDR) covers its range only.
    out = screen(
        ip4("10.1.2.3", "10.9.9.9", "169.254.169.254"), [ipaddress.IPv4Network("10.1.0.0/16")]
    )
    assert [str(ip) for ip in out.covered] == ["10.1.2.3"]
    assert [str(ip) for ip in out.dropped] == ["10.9.9.9", "169.254.169.254"]


def test_static_catalog_addresses_are_trusted_but_never_special(tmp_path: Path) -> None:
    def load(address: object) -> dict[str, Any]:
        path = tmp_path / "c.json"
        doc = {"services": {"m": {"hosts": ["m.test"], "addresses": {"m.test": [address]}}}}
        path.write_text(json.dumps(doc))
        return dict(load_catalog(path)["m"].addresses)

    assert load("10.0.0.5") == {"m.test": ("10.0.0.5",)}  # a private mirror: allowed
    for bad in ("169.254.169.254", "127.0.0.1", "100.64.0.2", "0.0.0.0", "224.0.0.1",
                2852039166, "0251.0376.0251.0376", "::ffff:169.254.169.254"):  # fmt: skip
        with pytest.raises(InvalidArgument):
            load(bad)


async def test_rebinding_answers_are_dropped_and_recorded() -> None:
    up = StaticUpstream(
        {
            "mixed.evil.test": Resolved(ip4("93.184.216.34", "169.254.169.254", "10.0.0.1")),
            "alias.evil.test": Resolved(ip4("192.168.1.10"), chain=("internal.corp.example",)),
            "stray.evil.test": Resolved(ip4("151.101.0.223"), stray=ip4("127.0.0.1")),
            "many.evil.test": Resolved(ip4(*(f"10.0.{i // 250}.{i % 250}" for i in range(500)))),
        }
    )
    dns = offline_dns({"evil": True}, {"evil": EVIL}, up)
    clock = FakeClock()  # one event per zone every 10 s: step past it between attempts
    dns.sandbox().events = EventLimiter(clock=clock)
    reply = await dns.ask("mixed.evil.test")
    assert rcode(reply) == "NOERROR" and answers(reply) == ["93.184.216.34"]
    assert dns.sandbox().learned == {"mixed.evil.test": ["93.184.216.34"]}
    clock.now += 10
    reply = await dns.ask("alias.evil.test")  # nothing left: an empty NOERROR
    assert rcode(reply) == "NOERROR" and answers(reply) == []
    clock.now += 10
    assert answers(await dns.ask("stray.evil.test")) == ["151.101.0.223"]
    clock.now += 10
    assert answers(await dns.ask("many.evil.test")) == []
    for _ in range(100):  # then the stream is held back, the count kept
        assert answers(await dns.ask("mixed.evil.test")) == ["93.184.216.34"]
    events = [d for k, d in dns.audit.events if k == EventKind.DNS_REBINDING]
    assert [e["name"] for e in events] == [
        "mixed.evil.test",
        "alias.evil.test",
        "stray.evil.test",
        "many.evil.test",
    ]
    assert events[0]["dropped"] == ["169.254.169.254", "10.0.0.1"]
    assert events[1]["cname"] == ["internal.corp.example"]
    assert events[2]["dropped"] == ["127.0.0.1"]
    assert len(events[3]["dropped"]) == 8 and events[3]["dropped_count"] == 32  # bounded
    rows = [d for a, d in dns.audit.records if a == "dns_rebinding_dropped"]
    assert len(rows) == 104 and len(events) == 4
    clock.now += 10
    await dns.ask("mixed.evil.test")
    assert dns.audit.events[-1][1]["suppressed"] == 100
    assert all(ip != "169.254.169.254" for ips in dns.sandbox().learned.values() for ip in ips)


async def test_a_rule_for_the_range_allows_its_answers() -> None:
    up = StaticUpstream({"meta.evil.test": Resolved(ip4("169.254.169.254", "10.1.2.3"))})
    dns = offline_dns({"evil": True, "metadata": True, "10.1.0.0/16:443": True}, {"evil": EVIL}, up)
    assert answers(await dns.ask("meta.evil.test")) == ["169.254.169.254", "10.1.2.3"]
    assert not dns.audit.events
    # Answered, but not learned: the static rule alone decides their ports.
    assert dns.sandbox().learned == {}


async def test_only_a_queries_of_allowed_names_go_upstream() -> None:
    up = StaticUpstream({"x.evil.test": Resolved(ip4("93.184.216.34"))})
    dns = offline_dns({"evil": True}, {"evil": EVIL}, up)
    for qtype in ("AAAA", "TXT", "NULL", "MX", "ANY", "SRV", "CNAME", "HTTPS"):
        reply = await dns.ask("x.evil.test", qtype)
        assert rcode(reply) == "NOERROR" and not reply.rr  # type: ignore[union-attr]
    assert rcode(await dns.ask("x.not-allowed.test")) == "REFUSED"
    assert up.asked == []
    # Case carries no bits upstream (0x20 encoding): the edge asks in lower case.
    assert answers(await dns.ask("X.EvIl.TeSt")) == ["93.184.216.34"]
    assert up.asked == ["x.evil.test"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tunnel_guard_limits_names_rate_and_new_names_per_zone() -> None:
    clock = FakeClock()
    guard = TunnelGuard(clock=clock)
    assert guard.name("a" * 48 + ".evil.test", "evil.test") is None
    assert guard.name("a" * 49 + ".evil.test", "evil.test") is Reason.LONG_LABEL
    assert guard.name(".".join(["a" * 40] * 4) + ".evil.test", "evil.test") is Reason.LONG_NAME
    assert guard.name("a.b.c.d.e.evil.test", "evil.test") is Reason.DEEP_NAME
    assert guard.name("x" * 200 + ".exact", None) is None  # exact names carry nothing
    # New short names: 64 per zone and window; repeats are free; the window slides.
    guard = TunnelGuard(clock=clock)
    assert all(guard.name(f"n{i}.evil.test", "evil.test") is None for i in range(64))
    assert guard.name("n64.evil.test", "evil.test") is Reason.UNIQUE_SUBDOMAINS
    assert guard.name("n3.evil.test", "evil.test") is None
    assert guard.name("n0.other.test", "other.test") is None  # zones are separate
    clock.now += 61
    assert guard.name("n64.evil.test", "evil.test") is None
    # Names that look like encoded data cost four times their length.
    guard = TunnelGuard(clock=clock)
    chunk = base64.b32encode(secrets.token_bytes(20)).decode().lower()  # 32 characters
    assert looks_like_data(chunk) and not looks_like_data("objects")
    passed = sum(
        guard.name(f"{chunk[i:] + chunk[:i]}.evil.test", "evil.test") is None for i in range(32)
    )
    assert passed == 2048 // (4 * 32)
    # The rate: a burst of 500, then 50 a second.
    guard = TunnelGuard(clock=clock)
    assert sum(guard.rate() is None for _ in range(1000)) == 500
    clock.now += 1
    assert sum(guard.rate() is None for _ in range(1000)) == 50
    assert guard.refused[Reason.QUERY_RATE] == 1450


def test_event_limiter_holds_back_and_counts() -> None:
    clock = FakeClock()
    limiter = EventLimiter(interval=10, clock=clock, max_keys=4)
    assert limiter.allow("k") == (True, 0)
    assert all(limiter.allow("k") == (False, 0) for _ in range(10_000))
    clock.now += 10
    assert limiter.allow("k") == (True, 10_000) and limiter.total["k"] == 10_002
    for i in range(100):
        limiter.allow(f"other{i}")
    assert len(limiter.last) <= 4 and len(limiter.total) <= 5 and len(limiter.held) <= 4


async def test_tunnelling_is_refused_and_events_are_rate_limited() -> None:
    dns = offline_dns({"evil": True}, {"evil": EVIL})
    for i in range(300):  # all A: each new name would reach the zone's servers
        await dns.ask(f"c{i}.evil.test")
    assert len(dns.upstream.asked) == 64
    kinds = [(k, d["reason"]) for k, d in dns.audit.events]
    assert kinds == [(EventKind.DNS_TUNNEL_SUSPECTED, "unique_subdomains")]
    await dns.ask("z" * 60 + ".evil.test", "TXT")
    assert dns.audit.events[-1][1]["reason"] == "long_label"
    for _ in range(1000):
        await dns.ask("exact.evil.test")
    rate = [d for _, d in dns.audit.events if d["reason"] == "query_rate"]
    assert len(rate) == 1 and len(dns.audit.events) == 3


async def test_honest_lookups_raise_nothing() -> None:
    """What pip, git and apt do: the same few names over and over, A and AAAA, a handful
    of CDN names below a wildcard."""
    github = DEFAULT_SERVICES["github"]
    names = ["pypi.org", "files.pythonhosted.org", "github.com", "objects.githubusercontent.com",
             "pkg-containers.githubusercontent.com", "release-assets.githubusercontent.com",
             "avatars.githubusercontent.com", "media.githubusercontent.com"]  # fmt: skip
    up = StaticUpstream({n: Resolved(ip4("151.101.0.223", "151.101.64.223")) for n in names})
    dns = offline_dns({"pypi": True, "github": True}, {"github": github}, up)
    for _ in range(30):
        for name in names:
            assert answers(await dns.ask(name)) == ["151.101.0.223", "151.101.64.223"]
            assert rcode(await dns.ask(name, "AAAA")) == "NOERROR"
    assert dns.audit.events == []
    assert not any(a == "dns_refused" for a, _ in dns.audit.records)


async def test_memory_is_bounded_whatever_the_sandbox_asks() -> None:
    up = StaticUpstream()
    dns = offline_dns({"evil": True}, {"evil": EVIL}, up)
    sb = dns.sandbox()
    sb.guard = TunnelGuard(
        Limits(query_rate=1e9, query_burst=1e9, zone_names=10**6, zone_budget=10**9)
    )
    for i in range(2000):  # each name a new set of public addresses
        up.records[f"r{i}.evil.test"] = Resolved(
            ip4(*(f"93.{i % 200}.{j}.{i // 200}" for j in range(4)))
        )
        await dns.ask(f"r{i}.evil.test")
    assert len(sb.learned) <= 256 and sb.learned_count <= 1024
    assert any(
        d.get("reason") == "address_limit" for a, d in dns.audit.records if a == "dns_refused"
    )
    assert len([1 for k, _ in dns.audit.events if k == EventKind.RESOURCE_LIMIT]) == 1
    guard = TunnelGuard()  # the default budget caps a zone's window
    for i in range(100_000):
        guard.name(f"m{i}.evil.test", "evil.test")
    assert len(guard.zones["evil.test"].seen) <= 64


def malformed_datagrams() -> list[bytes]:
    good = DNSRecord.question("x.evil.test").pack()
    header = good[:12]
    two = bytearray(good)
    two[5] = 2
    response = bytearray(good)
    response[2] |= 0x80
    loop = header[:5] + b"\x01" + header[6:] + b"\xc0\x0c\x00\x01\x00\x01"
    forward = header[:5] + b"\x01" + header[6:] + b"\xc0\x20\x00\x01\x00\x01"
    out = [b"", b"\x00", header, good[:-3], bytes(two), bytes(response), loop, forward,
           good + b"\x00" * 70_000, bytes(range(256)) * 8, header[:4] + b"\xff" * 8]  # fmt: skip
    for label in (b"a.b", b"\x00evil", b"a" * 64, b"\xff\xfe", b"a b", "é".encode()):
        out.append(
            header[:5]
            + b"\x01"
            + header[6:]
            + bytes([len(label)])
            + label
            + b"\x04evil\x04test\x00\x00\x01\x00\x01"
        )
    long_name = b"".join(bytes([63]) + b"a" * 63 for _ in range(5)) + b"\x04evil\x04test\x00"
    out.append(header[:5] + b"\x01" + header[6:] + long_name + b"\x00\x01\x00\x01")
    out.extend(secrets.token_bytes(n) for n in (12, 40, 300, 4000) for _ in range(50))
    return out


async def test_malformed_and_huge_queries_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    dns = offline_dns({"evil": True}, {"evil": EVIL})
    caplog.set_level(logging.DEBUG)
    for data in malformed_datagrams():
        reply = await dns.server.answer(data, dns.source)
        if reply is not None:
            assert DNSRecord.parse(reply).header.rcode in (RCODE.FORMERR, RCODE.REFUSED)
    assert dns.upstream.asked == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert any(d["reason"] == "malformed_name" for _, d in dns.audit.events)


async def test_upstream_client_follows_the_chain_of_the_name_only() -> None:
    with fake_resolver() as fake:
        fake.set(
            "a.evil.test",
            [
                ("a.evil.test", "CNAME", "b.cdn.example", 0),
                ("b.cdn.example", "A", "93.184.216.34", 0),
                ("metadata.google.internal", "A", "169.254.169.254", 0),
                ("a.evil.test", "AAAA", "::ffff:a9fe:a9fe", 0),
            ],
        )
        up = Upstream(("127.0.0.1", fake.port), timeout=2)
        got = await up.resolve("a.evil.test")
        assert got.addresses == ip4("93.184.216.34") and got.chain == ("b.cdn.example",)
        assert got.stray == ip4("169.254.169.254")
        assert (await up.resolve("nx.evil.test")).addresses == ()
        assert fake.queries == [("a.evil.test", "A"), ("nx.evil.test", "A")]
