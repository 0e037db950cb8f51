"""The cluster's edge registry, sandbox directory and watcher on real databases
(SQLite and PostgreSQL): heartbeats, lost sandboxes, reconciliation on return."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from dsec.api.cluster import EdgeReport
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import BackendKind, DSecContainerRunArgs
from dsec.cluster.registry import DOWN, EdgeRow, Registry, SandboxRow, sandbox_info
from dsec.cluster.watcher import Watcher
from dsec.control.db import make_engine, migrate, sqlite_url
from tests.ports import free_port


@pytest.fixture(params=["sqlite", "postgresql"])
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path / "control.db")
    else:
        url = request.getfixturevalue("pg_url")
    eng = make_engine(url)
    await migrate(eng)
    try:
        yield eng
    finally:
        await eng.dispose()


class Quota:
    """Records what the registry releases and charges again (the IAM's part)."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.released: list[str] = []
        self.recharged: list[str] = []
        self.refuse = refuse or set()

    async def release(self, ids: list[str]) -> None:
        self.released += ids

    async def recharge(self, infos: list[SandboxInfo]) -> list[str]:
        self.recharged += [i.id for i in infos]
        return [i.id for i in infos if i.id in self.refuse]


def report(edge: str = "e1", incarnation: str = "i1", **extra: object) -> EdgeReport:
    base: dict[str, object] = {
        "edge_id": edge,
        "url": "http://127.0.0.1:1",
        "incarnation": incarnation,
        "capacity": 10,
        "sandboxes": 0,
        "cpu_cores": 0,
        "cpu_committed": 0,
        "memory_mb": 1024,
        "memory_committed_mb": 0,
    }
    base.update(extra)
    return EdgeReport.model_validate(base)


def info(sid: str, job: str = "j1") -> SandboxInfo:
    now = datetime.now(UTC)
    return SandboxInfo(
        id=sid,
        backend=BackendKind.CONTAINER,
        state=SandboxState.RUNNING,
        image="busybox:latest",
        created_at=now,
        updated_at=now,
        edge=sid.split("-")[0],
        spec=DSecContainerRunArgs(container_image="busybox:latest", job_id=job),
    )


async def test_join_beat_and_end(engine: AsyncEngine) -> None:
    quota = Quota()
    reg = Registry(engine, release=quota.release, recharge=quota.recharge)
    first = await reg.heartbeat(report(live={}))
    assert not first.want_live and not first.stop
    for sid in ("e1-0000000000000001", "e1-0000000000000002"):
        await reg.created(info(sid))
    assert len(await reg.live_on("e1")) == 2
    await reg.heartbeat(report(ended={"e1-0000000000000001": "idle timeout"}))
    assert quota.released == ["e1-0000000000000001"]
    assert [i.id for i in await reg.live_on("e1")] == ["e1-0000000000000002"]
    row = await reg.sandbox("e1-0000000000000001")
    assert row is not None and row.state == "ended" and row.reason == "idle timeout"
    assert sandbox_info(row).state is SandboxState.STOPPED
    [edge] = await reg.edges()
    assert edge.status == "up" and edge.report.capacity == 10


async def test_down_edge_loses_its_sandboxes_then_reconciles(engine: AsyncEngine) -> None:
    quota = Quota(refuse={"e1-0000000000000003"})
    reg = Registry(engine, release=quota.release, recharge=quota.recharge)
    await reg.heartbeat(report(live={}))
    ids = [f"e1-000000000000000{i}" for i in range(1, 5)]
    for sid in ids:
        await reg.created(info(sid))
    await reg.ended(ids[3], "stopped by request")

    lost = await reg.mark_down("e1", "3 probes failed")
    assert sorted(lost) == ids[:3]
    assert sorted(quota.released) == ids[:3]
    assert await reg.mark_down("e1", "again") == []  # idempotent
    listed = await reg.lost(job_id="j1")
    assert {i.id for i in listed} == set(ids[:3])
    assert all(
        i.state is SandboxState.LOST and "3 probes failed" in (i.reason or "") for i in listed
    )

    # Back with a new incarnation: first the live list is asked for...
    back = await reg.heartbeat(report(incarnation="i2"))
    assert back.want_live
    # ...then: 1 re-adopted, 2 gone (ended), 3 re-adopted but over quota (stopped),
    # 4 was stopped while down (stopped), an old unknown one (stopped), a young
    # unknown one (a create still answering: kept).
    live = {ids[0]: 50.0, ids[2]: 50.0, ids[3]: 50.0, "e1-00000000000000aa": 500.0}
    live["e1-00000000000000bb"] = 1.0
    reply = await reg.heartbeat(report(incarnation="i2", live=live))
    assert sorted(reply.stop) == sorted([ids[2], ids[3], "e1-00000000000000aa"])
    assert sorted(quota.recharged) == sorted([ids[0], ids[2]])
    states = {sid: (await reg.sandbox(sid)) for sid in ids}
    assert {sid: r.state for sid, r in states.items() if r} == {
        ids[0]: "live",
        ids[1]: "ended",
        ids[2]: "ended",
        ids[3]: "ended",
    }


async def test_watcher_marks_a_silent_edge_down(engine: AsyncEngine) -> None:
    reg = Registry(engine)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    await reg.heartbeat(report("e1", url=dead))
    await reg.heartbeat(report("e2", url=dead))
    await reg.created(info("e1-0000000000000001"))
    # e1's last beat is old, e2's is fresh: only e1 may be marked down.
    from sqlalchemy.ext.asyncio import async_sessionmaker

    async with async_sessionmaker(engine)() as s, s.begin():
        await s.execute(
            update(EdgeRow).where(EdgeRow.edge_id == "e1").values(heartbeat_at=time.time() - 60)
        )
    watcher = Watcher(reg, failures=3, stale_after=5.0, probe_timeout=0.5)
    async with httpx.AsyncClient(timeout=0.5) as http:
        assert await watcher.run_once(http) == []
        assert await watcher.run_once(http) == []
        assert await watcher.run_once(http) == ["e1"]
    statuses = {e.edge_id: e for e in await reg.edges()}
    assert statuses["e1"].status == DOWN and "probes failed" in (statuses["e1"].down_reason or "")
    assert statuses["e2"].status == "up"
    row = await reg.sandbox("e1-0000000000000001")
    assert isinstance(row, SandboxRow) and row.state == "lost"
    # A restarted watcher starts from zero and rebuilds its view from the database.
    fresh = Watcher(reg, failures=3, stale_after=5.0, probe_timeout=0.5)
    async with httpx.AsyncClient(timeout=0.5) as http:
        assert await fresh.run_once(http) == []
    assert set(fresh.probes) == {"e2"}
