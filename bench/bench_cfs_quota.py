"""What a sandbox's CPU limit costs per create as the number of cgroups grows (issue 19).

    .venv/bin/python bench/bench_cfs_quota.py [--sizes 0,1000,4000] [--rounds 60]

crun writes a v1 cgroup's ``cpu.cfs_period_us`` and then ``cpu.cfs_quota_us``; the
kernel checks every write of either against every task group in the system
(tg_set_bandwidth -> __cfs_schedulable -> walk_tg_tree), so each costs O(N) with N cpu
cgroups on the host, raw crun included. Measured here, per fresh cpu cgroup, in an
empty private parent that holds N extra empty cpu cgroups (added between sizes),
interleaved each round:

- both: period (100000) then quota, what crun does when the spec names both;
- quota only: what crun does when the spec leaves the period out. A new task group's
  period is the kernel's default, 100 ms, so the limit is the same (checked);
- mkdir: the cgroup's creation alone (the floor, for scale).

Medians and p99 in microseconds. The host's own cpu cgroups (other work, sandboxes)
count too: their number is printed. Everything it makes is removed, also on failure.
Needs root and a v1 cpu hierarchy.

Measured on a quiet host (--sizes 0,1000,3000,6000 --rounds 90): both 36 / 44 / 79 /
168 µs, quota only 19 / 24 / 42 / 86 µs with 15 / 1,015 / 3,016 / 6,017 cpu cgroups.
Inside crun (strace -T of its writes, 3,000 quota-limited siblings) the two arms were
289 and 274 µs: a quota write after a period write is cheaper than one alone (the
first walk warms the cache), so leaving the period out buys next to nothing there and
the spec keeps naming it. The walk itself is the kernel's and cannot be skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import time
from pathlib import Path

from dsec.resources import cgroups

PERIOD = 100_000
QUOTA = 50_000


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _count_dirs(root: Path) -> int:
    return sum(1 for _ in os.walk(root))


def _one(parent: Path, arm: str) -> tuple[float, float]:
    """(mkdir µs, writes µs) of one fresh cgroup; removed again."""
    d = parent / f"x{secrets.token_hex(4)}"
    t0 = time.perf_counter()
    d.mkdir()
    t1 = time.perf_counter()
    try:
        if arm == "both":
            (d / "cpu.cfs_period_us").write_text(str(PERIOD))
        if arm != "mkdir":
            (d / "cpu.cfs_quota_us").write_text(str(QUOTA))
        t2 = time.perf_counter()
        if arm == "quota only":
            assert int((d / "cpu.cfs_period_us").read_text()) == PERIOD
    finally:
        d.rmdir()
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,1000,4000")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    host = cgroups.detect()
    if "cpu" not in host.v1:
        raise SystemExit("needs a cgroup v1 cpu hierarchy")
    cpu = host.v1["cpu"]
    parent = cpu / f"dsec-bench-cfs-{secrets.token_hex(4)}"
    parent.mkdir()
    fill = parent / "fill"
    fill.mkdir()
    made = 0
    results: list[dict[str, object]] = []
    try:
        for n in (int(x) for x in args.sizes.split(",")):
            while made < n:
                (fill / f"f{made}").mkdir()
                made += 1
            arms = ["both", "quota only", "mkdir"]
            times: dict[str, list[float]] = {a: [] for a in arms}
            mk: list[float] = []
            for r in range(args.rounds):
                for arm in arms[r % 3 :] + arms[: r % 3]:
                    m, w = _one(parent, arm)
                    (mk if arm == "mkdir" else times[arm]).append(m if arm == "mkdir" else w)
            total = _count_dirs(cpu)
            row: dict[str, object] = {"extra_cgroups": n, "host_cpu_cgroups": total}
            for arm in ("both", "quota only"):
                row[arm] = {
                    "p50_us": round(statistics.median(times[arm]), 1),
                    "p99_us": round(_pct(times[arm], 0.99), 1),
                }
            row["mkdir"] = {
                "p50_us": round(statistics.median(mk), 1),
                "p99_us": round(_pct(mk, 0.99), 1),
            }
            results.append(row)
            print(json.dumps(row))
    finally:
        for i in range(made):
            (fill / f"f{i}").rmdir()
        fill.rmdir()
        parent.rmdir()


if __name__ == "__main__":
    main()
