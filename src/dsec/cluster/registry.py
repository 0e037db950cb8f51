"""Cluster state of edges and sandboxes, in the control database (SQLite or PostgreSQL).

Apiservers keep nothing about sandboxes in memory; what must outlive an edge — which
sandboxes it held, so that they can be reported ``lost`` with a reason and their
quota released — lives here. One row per edge (its last heartbeat and status) and one
per sandbox (the directory: where it runs, whose job, live / lost / ended).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from sqlalchemy import JSON, Float, Index, String, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.api.cluster import EdgeReport, EdgeStatus, HeartbeatReply
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.cluster.keys import KeyPins
from dsec.control.db import Base

UP = "up"
DOWN = "down"
LIVE = "live"
LOST = "lost"
ENDED = "ended"

# A sandbox on an edge that the directory does not know is only stopped once it is
# older than this: younger ones may be creates whose answer is still on its way.
ORPHAN_GRACE_S = 120.0
ENDED_RETENTION_S = 86_400.0

Release = Callable[[list[str]], Awaitable[object]]
# Charge again what an edge re-adopted (its charge was released when it was lost);
# returns the ids that no longer fit the quota, which the edge is then told to stop.
Recharge = Callable[[list[SandboxInfo]], Awaitable[list[str]]]


class EdgeRow(Base):
    __tablename__ = "cluster_edges"

    edge_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    url: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(8))
    incarnation: Mapped[str] = mapped_column(String(64))
    registered_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    down_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    down_reason: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    report: Mapped[dict[str, Any]] = mapped_column(JSON)


class SandboxRow(Base):
    __tablename__ = "cluster_sandboxes"
    __table_args__ = (Index("ix_cluster_sandboxes_edge_state", "edge_id", "state"),)

    sandbox_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    edge_id: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    project: Mapped[str | None] = mapped_column(String(512), nullable=True)
    state: Mapped[str] = mapped_column(String(8))
    reason: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    info: Mapped[dict[str, Any]] = mapped_column(JSON)


def _status(row: EdgeRow) -> EdgeStatus:
    return EdgeStatus(
        edge_id=row.edge_id,
        url=row.url,
        status=row.status,
        incarnation=row.incarnation,
        heartbeat_at=row.heartbeat_at,
        down_since=row.down_since,
        down_reason=row.down_reason,
        report=EdgeReport.model_validate(row.report),
    )


def sandbox_info(row: SandboxRow) -> SandboxInfo:
    """The directory's word on a sandbox whose edge cannot be asked."""
    info = SandboxInfo.model_validate(row.info)
    if row.state == LOST:
        info.state = SandboxState.LOST
    elif row.state == ENDED and not info.state.terminal:
        info.state = SandboxState.STOPPED
    info.reason = row.reason or info.reason
    info.data_path = None
    return info


async def _noop(_ids: list[str]) -> None:
    return None


async def _fits(_infos: list[SandboxInfo]) -> list[str]:
    return []


class Registry:
    """Edges and the sandbox directory; every method is one short transaction."""

    def __init__(
        self, engine: AsyncEngine, *, release: Release = _noop, recharge: Recharge = _fits
    ) -> None:
        self._sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self.keys = KeyPins(engine)  # Idempotency-Key -> edge (dsec.cluster.keys)
        self._release = release
        self._recharge = recharge

    def on_quota(self, release: Release, recharge: Recharge) -> None:
        """Who gives back the quota of sandboxes that ended or were lost, and charges it
        again when a lost one is re-adopted (dsec.control.iam)."""
        self._release, self._recharge = release, recharge

    # -- edges ----------------------------------------------------------------------------
    async def heartbeat(self, report: EdgeReport) -> HeartbeatReply:
        """Record a beat; reconcile the directory when the edge sends its live list."""
        now = time.time()
        reply = HeartbeatReply()
        released: list[str] = []
        adopted: list[SandboxInfo] = []
        async with self._sessions() as s, s.begin():
            row = await s.get(EdgeRow, report.edge_id, with_for_update=True)
            returning = row is None or row.status == DOWN or row.incarnation != report.incarnation
            body = report.model_dump(mode="json", exclude={"live", "ended"})
            if row is None:
                s.add(
                    EdgeRow(
                        edge_id=report.edge_id,
                        url=report.url,
                        status=UP,
                        incarnation=report.incarnation,
                        registered_at=now,
                        heartbeat_at=now,
                        report=body,
                    )
                )
            else:
                row.url, row.incarnation, row.report = report.url, report.incarnation, body
                row.heartbeat_at, row.status = now, UP
                row.down_since = row.down_reason = None
            if report.ended:
                released += await self._end(s, report.ended, now)
            if report.live is not None:
                reply.stop, adopted = await self._reconcile(s, report.edge_id, report.live, now)
            elif returning:
                reply.want_live = True
        if released:
            await self._release(released)
        if adopted:
            over = await self._recharge(adopted)
            if over:
                await self._end_many(over, "re-adopted over its project's quota")
                reply.stop += over
        return reply

    async def _end_many(self, ids: list[str], reason: str) -> None:
        async with self._sessions() as s, s.begin():
            await self._end(s, dict.fromkeys(ids, reason), time.time())

    async def _end(self, s: AsyncSession, ended: dict[str, str], now: float) -> list[str]:
        rows = (
            await s.scalars(select(SandboxRow).where(SandboxRow.sandbox_id.in_(list(ended))))
        ).all()
        for row in rows:
            if row.state != ENDED:
                row.state, row.reason, row.updated_at = ENDED, ended[row.sandbox_id], now
        return list(ended)

    async def _reconcile(
        self, s: AsyncSession, edge_id: str, live: dict[str, float], now: float
    ) -> tuple[list[str], list[SandboxInfo]]:
        """Lost sandboxes still alive are re-adopted, the rest ended; sandboxes the
        directory does not know (or stopped while the edge was away) are stopped.
        Returns (to stop, re-adopted)."""
        rows = (
            await s.scalars(
                select(SandboxRow).where(
                    SandboxRow.edge_id == edge_id, SandboxRow.state.in_([LIVE, LOST])
                )
            )
        ).all()
        known = {row.sandbox_id: row for row in rows}
        adopted: list[SandboxInfo] = []
        for sid, row in known.items():
            if sid in live:
                if row.state == LOST:
                    row.state, row.updated_at = LIVE, now
                    row.reason = f"re-adopted when edge {edge_id} came back"
                    adopted.append(SandboxInfo.model_validate(row.info))
            elif row.state == LIVE and now - row.created_at < ORPHAN_GRACE_S:
                continue  # its create may still be answering
            else:
                row.state, row.updated_at = ENDED, now
                row.reason = row.reason or f"not found on edge {edge_id}"
        unknown = [sid for sid in live if sid not in known]
        stop: list[str] = []
        if unknown:
            ended = set(
                await s.scalars(
                    select(SandboxRow.sandbox_id).where(
                        SandboxRow.sandbox_id.in_(unknown), SandboxRow.state == ENDED
                    )
                )
            )
            stop = [sid for sid in unknown if sid in ended or live[sid] > ORPHAN_GRACE_S]
        return stop, adopted

    async def edges(self) -> list[EdgeStatus]:
        async with self._sessions() as s:
            rows = (await s.scalars(select(EdgeRow).order_by(EdgeRow.edge_id))).all()
        return [_status(row) for row in rows]

    async def edge(self, edge_id: str) -> EdgeStatus | None:
        async with self._sessions() as s:
            row = await s.get(EdgeRow, edge_id)
        return None if row is None else _status(row)

    async def mark_down(self, edge_id: str, reason: str) -> list[str]:
        """The edge stopped answering: its live sandboxes become ``lost`` (quota
        released); returns their ids. Idempotent."""
        now = time.time()
        async with self._sessions() as s, s.begin():
            row = await s.get(EdgeRow, edge_id, with_for_update=True)
            if row is None or row.status == DOWN:
                return []
            row.status, row.down_since, row.down_reason = DOWN, now, reason
            lost = list(
                await s.scalars(
                    select(SandboxRow.sandbox_id).where(
                        SandboxRow.edge_id == edge_id, SandboxRow.state == LIVE
                    )
                )
            )
            if lost:
                await s.execute(
                    update(SandboxRow)
                    .where(SandboxRow.edge_id == edge_id, SandboxRow.state == LIVE)
                    .values(state=LOST, reason=f"edge {edge_id} is down: {reason}", updated_at=now)
                )
        if lost:
            await self._release(lost)
        return lost

    async def forget_edge(self, edge_id: str) -> bool:
        """Remove a down edge for good (decommissioned); its lost sandboxes stay listed."""
        async with self._sessions() as s, s.begin():
            res = await s.execute(
                delete(EdgeRow).where(EdgeRow.edge_id == edge_id, EdgeRow.status == DOWN)
            )
        return bool(getattr(res, "rowcount", 0))

    # -- sandbox directory ----------------------------------------------------------------
    async def created(self, info: SandboxInfo) -> None:
        """Enter a new sandbox. Answers to one keyed create, through several apiservers
        (dsec.cluster.keys), enter it once: the first row stands."""
        now = time.time()
        body = info.model_dump(mode="json", exclude={"data_path"})
        row = SandboxRow(
            sandbox_id=info.id,
            edge_id=info.edge,
            job_id=info.spec.job_id,
            project=info.spec.project,
            state=LIVE,
            reason=None,
            created_at=now,
            updated_at=now,
            info=body,
        )
        with contextlib.suppress(IntegrityError):  # ids are unique per edge: a replay
            async with self._sessions() as s, s.begin():
                s.add(row)

    async def ended(self, sandbox_id: str, reason: str) -> None:
        async with self._sessions() as s, s.begin():
            await self._end(s, {sandbox_id: reason}, time.time())

    async def sandbox(self, sandbox_id: str) -> SandboxRow | None:
        async with self._sessions() as s:
            return await s.get(SandboxRow, sandbox_id)

    async def lost(self, *, job_id: str | None = None, limit: int = 10_000) -> list[SandboxInfo]:
        query = select(SandboxRow).where(SandboxRow.state == LOST)
        if job_id is not None:
            query = query.where(SandboxRow.job_id == job_id)
        async with self._sessions() as s:
            rows = (await s.scalars(query.order_by(SandboxRow.created_at).limit(limit))).all()
        return [sandbox_info(row) for row in rows]

    async def live_on(self, edge_id: str) -> list[SandboxInfo]:
        """What the directory last knew to run on ``edge_id`` (when it cannot be asked)."""
        query = select(SandboxRow).where(SandboxRow.edge_id == edge_id, SandboxRow.state == LIVE)
        async with self._sessions() as s:
            rows = (await s.scalars(query.order_by(SandboxRow.created_at))).all()
        return [sandbox_info(row) for row in rows]

    async def live_ids(self, edge_ids: Iterable[str] | None = None) -> list[str]:
        query = select(SandboxRow.sandbox_id).where(SandboxRow.state == LIVE)
        if edge_ids is not None:
            query = query.where(SandboxRow.edge_id.in_(list(edge_ids)))
        async with self._sessions() as s:
            return list(await s.scalars(query))

    async def prune(self, older_than: float = ENDED_RETENTION_S) -> int:
        """Forget sandboxes that ended long ago (the audit log keeps their history), and
        expired Idempotency-Key pins."""
        await self.keys.prune()
        cutoff = time.time() - older_than
        async with self._sessions() as s, s.begin():
            res = await s.execute(
                delete(SandboxRow).where(SandboxRow.state == ENDED, SandboxRow.updated_at < cutoff)
            )
        return int(getattr(res, "rowcount", 0) or 0)
