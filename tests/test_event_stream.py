"""GET /v1/events/stream and client.follow_audit, on a real platform: records arrive as
they are written, resume exactly after a reconnect, filters hold, and no text a
sandbox writes can end a frame early or forge a record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient
from dsec.api.events import AuditRecord
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

SPEC = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
FORGED = 'id: 999999999\\nevent: event\\ndata: {"seq": 999999999}\\n\\n'


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        with DSecSyncClient(p.url, p.api_key) as c:
            c.build_image("busybox")
        yield p


@pytest.fixture
async def client(plat: PlatformProcess) -> AsyncIterator[DSecClient]:
    c = DSecClient(plat.url, plat.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


async def last_seq(client: DSecClient) -> int:
    rows = await client.audit(limit=10_000)
    return rows[-1].seq if rows else 0


async def collect(
    stream: AsyncIterator[AuditRecord], until: str, timeout: float = 30
) -> list[AuditRecord]:
    """Records until one whose action is ``until`` (then stop following)."""
    got: list[AuditRecord] = []

    async def read() -> None:
        async for r in stream:
            got.append(r)
            if r.action == until:
                return

    await asyncio.wait_for(read(), timeout)
    await stream.aclose()  # type: ignore[attr-defined]
    return got


async def test_a_sandbox_s_life_arrives_as_it_happens(client: DSecClient) -> None:
    since = await last_seq(client)
    stream = client.follow_audit(since_seq=since)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.2)  # the follower is connected and idle
    t0 = time.monotonic()
    sb = await client.run_container(SPEC)
    r0 = await asyncio.wait_for(first, 10)
    latency = time.monotonic() - t0
    await sb.run_shell(f"printf '{FORGED}'; reboot -f; true")
    await sb.stop()
    rows = [r0, *await collect(stream, until="stopped")]
    ours = [r for r in rows if r.sandbox_id == sb.id]
    assert ours and latency < 5, latency
    actions = [r.action for r in ours]
    assert actions[0] == "create" and actions[-1] == "stopped", actions
    seqs = [r.seq for r in rows]
    assert seqs == sorted(set(seqs)) and seqs[0] > since  # in order, once each
    assert 999999999 not in seqs  # the sandbox's text stayed inside its record
    assert any(FORGED.split("\\n")[0] in str(r.detail) for r in ours)
    assert any(r.kind.value == "event" for r in ours), actions  # reboot: seccomp event


async def test_reconnect_resumes_after_the_last_record(
    client: DSecClient, plat: PlatformProcess
) -> None:
    sb = await client.run_container(SPEC)
    await sb.stop()
    headers = {"Authorization": f"Bearer {plat.api_key}"}
    url = f"{plat.url}/v1/events/stream"
    params = {"sandbox_id": sb.id}
    async with httpx.AsyncClient(timeout=10) as http:
        seen: list[int] = []
        async with http.stream("GET", url, params=params, headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    seen.append(int(line[4:]))
                    if len(seen) == 2:
                        break
        resumed: list[int] = []
        headers["Last-Event-ID"] = str(seen[0])
        async with http.stream("GET", url, params=params, headers=headers) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    resumed.append(int(line[4:]))
                    break
        assert resumed == [seen[1]]  # the next record after the one acknowledged
        bad = await http.get(url, headers={**headers, "Last-Event-ID": "x"})
        assert bad.status_code == 422


async def test_filters_and_auth(client: DSecClient, plat: PlatformProcess) -> None:
    since = await last_seq(client)
    a = await client.run_container(SPEC)
    b = await client.run_container(SPEC)
    await a.stop()
    await b.stop()
    rows = await collect(
        client.follow_audit(sandbox=b.id, kinds=["lifecycle"], since_seq=since), until="stopped"
    )
    assert {r.sandbox_id for r in rows} == {b.id}
    assert {r.kind.value for r in rows} == {"lifecycle"}
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{plat.url}/v1/events/stream")
        assert r.status_code == 401


def test_the_sync_twin_follows_too(plat: PlatformProcess) -> None:
    with DSecSyncClient(plat.url, plat.api_key) as client:
        rows = client.audit(limit=10_000)
        since = rows[-1].seq if rows else 0
        sb = client.run_container(SPEC)
        sb.stop()
        for r in client.follow_audit(sandbox=sb.id, since_seq=since):
            if r.action == "stopped":
                break
        assert r.sandbox_id == sb.id


def test_dsec_audit_follow_prints_json_lines(plat: PlatformProcess) -> None:
    import json
    import subprocess
    import sys

    with DSecSyncClient(plat.url, plat.api_key) as client:
        sb = client.run_container(SPEC)
        sb.stop()
    argv = [sys.executable, "-m", "dsec.cli.main", "--url", plat.url, "--api-key", plat.api_key]
    argv += ["audit", "--follow", "--json", "--sandbox", sb.id, "--kind", "lifecycle"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["sandbox_id"] == sb.id and first["kind"] == "lifecycle"
    finally:
        proc.terminate()
        proc.wait(10)


def test_stats_and_dsec_top(plat: PlatformProcess) -> None:
    """GET /v1/stats reads each live sandbox's cgroup; `dsec top --once` shows it."""
    import json
    import os
    import subprocess
    import sys

    with DSecSyncClient(plat.url, plat.api_key) as client:
        sb = client.run_container(SPEC.model_copy(update={"job_id": "top-job"}))
        try:
            sb.run_shell("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")  # some CPU
            (row,) = [r for r in client.stats() if r.id == sb.id]
            assert row.state.value == "running" and row.job_id == "top-job"
            assert row.memory_bytes and row.memory_bytes > 0
            assert row.cpu_seconds and row.cpu_seconds > 0
            assert 0 <= row.idle_seconds < 60
            argv = [sys.executable, "-m", "dsec.cli.main", "--url", plat.url]
            argv += ["--api-key", plat.api_key, "top", "--once"]
            shown = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60)
            assert sb.id in {r["id"] for r in json.loads(shown.stdout)}, shown.stderr
            wide = {**os.environ, "COLUMNS": "220"}
            table = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=wide)
            assert sb.id in table.stdout and "top-job" in table.stdout, table.stderr
        finally:
            sb.stop()
        assert sb.id not in {r.id for r in client.stats()}


def test_cpu_shares_are_deltas_over_time() -> None:
    from datetime import UTC, datetime

    from dsec.api.sandbox import SandboxStats
    from dsec.cli.top import cpu_shares

    def row(sid: str, cpu: float) -> SandboxStats:
        return SandboxStats.model_validate(
            {"id": sid, "backend": "container", "state": "running", "image": "i", "edge": "e",
             "created_at": datetime.now(UTC), "idle_seconds": 0, "cpu_seconds": cpu}
        )  # fmt: skip

    before: dict[str, tuple[float, float]] = {}
    assert cpu_shares(before, [row("a", 1.0), row("b", 5.0)], 10.0) == {}
    shares = cpu_shares(before, [row("a", 1.5)], 11.0)
    assert shares == {"a": 50.0} and set(before) == {"a"}  # b is gone, forgotten
