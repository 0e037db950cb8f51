"""Cost of DNS rebinding and tunnelling protection (issue 12.3), one run, side by side.

    .venv/bin/python bench/bench_dns.py [--queries 20000] [--rounds 20] [--sandbox]

In process: the edge's responder answers real query datagrams through the same code
as a sandbox's (``DnsServer.answer`` -> ``NetworkManager._resolve``), with an in-process
upstream, two ways: ``checked`` (the shipped path: rate bucket, name limits, zone
budget, answer screening, bounded learning) and ``unchecked`` (the same path with the
guard and the screening replaced by no-ops: what the responder cost before). Rounds
alternate between the two so that host noise falls on both alike. Three query kinds:
an exact name with a static catalog answer, a wildcard name answered upstream (two
public addresses), and a wildcard name whose answer mixes public and private addresses
(the screening's drop path). Per kind and mode: p50/p99 per query, and the ratio.

With ``--sandbox``: a real platform and sandbox, the round trip of a query from inside
(a static C client, tests/adversary/dnsq.c, 400 queries at a time, under the rate
limit's burst) for scale. Writes bench/results/dns.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dnslib import DNSRecord  # noqa: E402
from tests.fakenet import OfflineDns, StaticUpstream, offline_dns  # noqa: E402

from dsec.net.catalog import Service  # noqa: E402
from dsec.net.dns import Resolved  # noqa: E402
from dsec.net.dnsguard import Limits, Reason, Screened, TunnelGuard  # noqa: E402

EVIL = Service(
    name="evil",
    hosts=("*.evil.test", "static.evil.test"),
    ports=((80, 80),),
    addresses={"static.evil.test": ("151.101.1.1",)},  # never connected to
)
KINDS = {
    "static_exact": "static.evil.test",
    "upstream_wildcard": "cdn.evil.test",
    "upstream_mixed": "mixed.evil.test",
}
UNBOUNDED = Limits(query_rate=1e12, query_burst=1e12, zone_names=10**9, zone_budget=10**12)


class NoGuard(TunnelGuard):
    """The checks off: every query admitted."""

    def rate(self) -> Reason | None:
        return None

    def name(self, name: str, zone: str | None) -> Reason | None:
        return None


def keep_all(sb: Any, addresses: Any) -> Screened:
    return Screened(list(addresses), [], [])


def responder(checked: bool) -> OfflineDns:
    ip = ipaddress.IPv4Address
    up = StaticUpstream(
        {
            "cdn.evil.test": Resolved((ip("151.101.0.223"), ip("151.101.64.223"))),
            "mixed.evil.test": Resolved((ip("151.101.0.223"), ip("169.254.169.254"))),
        }
    )
    dns = offline_dns({"evil": True}, {"evil": EVIL}, up)
    sb = dns.sandbox()
    if checked:
        # The shipped checks, with limits no bench loop reaches (a flood would be refused
        # early, which is cheaper and not what is measured here).
        sb.guard = TunnelGuard(UNBOUNDED)
    else:
        sb.guard = NoGuard()
        dns.manager._screen = keep_all  # type: ignore[method-assign]
    return dns


async def measure(dns: OfflineDns, packet: bytes, n: int) -> list[float]:
    out = []
    answer, source = dns.server.answer, dns.source
    for _ in range(n):
        t = time.perf_counter()
        await answer(packet, source)
        out.append(time.perf_counter() - t)
    dns.audit.records.clear()
    dns.audit.events.clear()
    dns.upstream.asked.clear()
    return out


def stats(samples: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples)
    return {
        "n": len(us),
        "p50_us": round(statistics.median(us), 2),
        "p99_us": round(us[min(len(us) - 1, int(0.99 * (len(us) - 1)))], 2),
    }


async def in_process(queries: int, rounds: int) -> dict[str, Any]:
    modes = {"unchecked": responder(False), "checked": responder(True)}
    samples: dict[str, dict[str, list[float]]] = {m: {k: [] for k in KINDS} for m in modes}
    packets = {k: bytes(DNSRecord.question(name).pack()) for k, name in KINDS.items()}
    per_round = max(1, queries // rounds)
    for dns in modes.values():  # warm up
        for k in KINDS:
            await measure(dns, packets[k], 200)
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for k in KINDS:
            for m in order:
                samples[m][k].extend(await measure(modes[m], packets[k], per_round))
    out: dict[str, Any] = {}
    for k in KINDS:
        row: dict[str, Any] = {m: stats(samples[m][k]) for m in modes}
        base, checked = row["unchecked"]["p50_us"], row["checked"]["p50_us"]
        row["added_p50_us"] = round(checked - base, 2)
        row["ratio_p50"] = round(checked / base, 3)
        row["ratio_p99"] = round(row["checked"]["p99_us"] / row["unchecked"]["p99_us"], 3)
        out[k] = row
    return out


def through_sandbox(batches: int) -> dict[str, Any]:
    """Round trip of a query from inside a real sandbox (static answers: no upstream)."""
    import json as _json
    import tempfile

    from tests.conftest import platform_process

    from dsec import DSecContainerRunArgs, DSecSyncClient
    from dsec.native import binary

    program = binary(
        REPO / "tests" / "adversary" / "dnsq.c",
        name="dnsq",
        subdir="tests",
        cflags=["-static", "-O1", "-w"],
        what="the DNS client",
    ).read_bytes()
    with tempfile.TemporaryDirectory(prefix="dsec-bdns-") as tmp:
        catalog = Path(tmp) / "catalog.json"
        evil = {
            "hosts": ["static.evil.test"],
            "ports": [80],
            "addresses": {"static.evil.test": ["151.101.1.1"]},  # never connected to
        }
        catalog.write_text(_json.dumps({"services": {"evil": evil}}))
        with (
            platform_process(DSEC_NETWORK_CATALOG=str(catalog)) as plat,
            DSecSyncClient(plat.url, plat.api_key) as c,
        ):
            c.build_image("busybox")
            per_query: list[float] = []
            for _ in range(batches):  # a fresh sandbox each: a full rate-limit burst
                spec = DSecContainerRunArgs(
                    container_image="busybox:latest",
                    network_rules={"evil": True},
                    memory_limit_mb=64,
                )
                sb = c.run_container(spec, timeout=60)
                try:
                    sb.write_file("/usr/local/bin/dnsq", program, mode=0o755)
                    sb.write_file("/tmp/n", "static.evil.test\n")
                    cmd = (
                        "/usr/local/bin/dnsq $(awk '/^nameserver/ {print $2; exit}'"
                        " /etc/resolv.conf) 1 /tmp/n COUNT"
                    )
                    # The exec's own cost cancels out: 401 queries minus 1 query.
                    t = time.perf_counter()
                    one = sb.run_shell(cmd.replace("COUNT", "1"), timeout=60)
                    t_one = time.perf_counter() - t
                    t = time.perf_counter()
                    many = sb.run_shell(cmd.replace("COUNT", "401"), timeout=60)
                    t_many = time.perf_counter() - t
                    assert "noerror=401" in many.stdout and "noerror=1" in one.stdout, many.stdout
                    per_query.append((t_many - t_one) / 400)
                finally:
                    sb.stop()
    us = sorted(x * 1e6 for x in per_query)
    return {"batches": len(us), "mean_round_trip_us_p50": round(statistics.median(us), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sandbox", action="store_true")
    ap.add_argument("--batches", type=int, default=5)
    opts = ap.parse_args()
    result: dict[str, Any] = {"in_process": asyncio.run(in_process(opts.queries, opts.rounds))}
    for kind, row in result["in_process"].items():
        print(
            f"{kind:18} unchecked p50 {row['unchecked']['p50_us']:7.1f} us"
            f" p99 {row['unchecked']['p99_us']:7.1f} us | checked p50"
            f" {row['checked']['p50_us']:7.1f} us p99 {row['checked']['p99_us']:7.1f} us"
            f" | +{row['added_p50_us']:.1f} us, ratio p50 {row['ratio_p50']:.3f}"
            f" p99 {row['ratio_p99']:.3f}"
        )
    if opts.sandbox:
        result["sandbox"] = through_sandbox(opts.batches)
        print(f"through a sandbox: {result['sandbox']}")
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "dns.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
