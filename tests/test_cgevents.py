"""Limit events come from the kernel, not from a scan (issue 19, item 4): real cgroups,
a real OOM kill and real refused forks, and the callback must name the cgroup's key
within a second. Also: the limit watcher's safety-net sweep reads a bounded number of
sandboxes per tick, whatever their number. ~2 s on this host."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.resources import cgroups
from dsec.resources.cgevents import CgroupEvents
from dsec.security.audit import AuditLog
from dsec.security.limits import LimitReading, LimitWatcher, read_cgroup_counters
from tests.waiting import until_async

MiB = 1024 * 1024


@pytest.fixture
def parent() -> Iterator[str]:
    rel = f"dsec-cgev-{secrets.token_hex(4)}"
    yield rel
    host = cgroups.detect()
    for child in host.children(rel):
        host.kill_and_remove(f"{rel}/{child}", timeout=5)
    host.kill_and_remove(rel, timeout=5)


def start_in(procs: list[Any], script: str) -> subprocess.Popen[bytes]:
    """``sh -c script`` after moving itself into the cgroup (every hierarchy)."""
    join = "for f in " + " ".join(str(p) for p in procs) + '; do echo $$ > "$f"; done; '
    return subprocess.Popen(
        ["sh", "-c", join + script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@pytest.mark.root
async def test_oom_kill_and_refused_fork_are_notified(parent: str) -> None:
    host = cgroups.detect()
    seen: list[str] = []
    events = CgroupEvents(host, seen.append, bucket=2)
    events.start()
    procs = {
        name: host.create_limited(f"{parent}/{name}", memory_bytes=32 * MiB, cpu_cores=1, pids=4)
        for name in ("quiet", "oom", "forks")
    }
    try:
        for name in procs:
            assert events.watch(name, f"{parent}/{name}")
        # A memory hog, a fork storm: both exit on their own, no command reports them.
        hog = start_in(procs["oom"], "head -c 200000000 /dev/zero | tail > /dev/null")
        storm = start_in(procs["forks"], "for i in 1 2 3 4 5 6 7 8; do sleep 1 & done; wait")
        await until_async("an oom event", lambda: "oom" in seen, 3.0)
        hog.wait(timeout=10)
        storm.wait(timeout=10)
        oom, _ = read_cgroup_counters(host, f"{parent}/oom")
        _, refused = read_cgroup_counters(host, f"{parent}/forks")
        assert oom and oom >= 1 and refused and refused >= 1
        # v1 pids.events is silent (the limit watcher's sweep finds those): v2 only.
        if events.notifies_forks:
            await until_async("a forks event", lambda: "forks" in seen, 3.0)
        # Unwatched: no more callbacks for it; a second OOM there is not reported.
        events.unwatch("oom")
        seen.clear()
        again = start_in(procs["oom"], "head -c 200000000 /dev/zero | tail > /dev/null")
        again.wait(timeout=10)
        await asyncio.sleep(0.2)
        assert "oom" not in seen
    finally:
        events.close()


def test_sweep_is_bounded_and_round_robin() -> None:
    reads: list[str] = []

    def probe(rec: Any) -> LimitReading:
        reads.append(rec.id)
        return LimitReading(0, 0, None)

    w = LimitWatcher(AuditLog(None), probe, per_tick=3)
    recs = [type("Rec", (), {"id": f"s{i}", "spec": None})() for i in range(10)]
    for rec in recs:
        w.track(rec.id)
        w.watch(rec)
    batches = [[r.id for r in w.next_batch()] for _ in range(4)]
    assert batches == [
        ["s0", "s1", "s2"],
        ["s3", "s4", "s5"],
        ["s6", "s7", "s8"],
        ["s9", "s0", "s1"],
    ]
    w.forget("s2")
    assert w.watched == 9 and all(r.id != "s2" for r in w.next_batch() + w.next_batch())
