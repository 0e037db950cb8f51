"""Idempotent creates in cluster mode: a key is pinned to one edge, the edge dedupes.

A single edge already makes at most one sandbox per ``Idempotency-Key``
(dsec.edge.idempotency). In a cluster a retry may reach another apiserver and would be
placed anew, possibly on another edge, so the cluster adds one thing: the first create
with a key *pins* it to the edge it is sent to, in the control database, before the
request leaves. Every create with that key, through any apiserver, goes to that edge
with the same edge-side key, and the edge answers "made" or "replayed". So:

- two apiservers racing on one key: one pin wins (primary key), the other sends its
  create to the winner's edge, which makes the sandbox once;
- an edge that *refused* (admission, no image: nothing was made) gives the pin back
  and the create is placed on the next candidate;
- an edge that did not answer keeps the pin: it may have made the sandbox, and a retry
  must go there. Only once the watcher has marked that edge down, and no sandbox was
  recorded for the key, is the pin released and the create placed elsewhere; a sandbox
  the edge made meanwhile is unknown to the directory and stopped when the edge returns
  (dsec.cluster.registry, ``ORPHAN_GRACE_S``);
- a key pinned with another spec is ``IdempotencyKeyReused`` (409);
- pins expire with the edge's keys (``KEY_TTL``) and are pruned by the watcher.

The edge-side key is a hash of the scope (principal and project) and the client's key,
so that tenants never share keys and the edge's own scope (the cluster's token) adds
nothing.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from sqlalchemy import Float, String, delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.api.sandbox import IDEMPOTENCY_HEADER
from dsec.control.db import Base
from dsec.edge.idempotency import KEY_TTL, IdempotencyClaim
from dsec.errors import IdempotencyKeyReused


class KeyPinRow(Base):
    __tablename__ = "cluster_create_keys"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    edge_id: Mapped[str] = mapped_column(String(16))
    sandbox_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


@dataclass(frozen=True)
class KeyPin:
    """Where a key's create goes (``edge_id``) and, once known, what it made."""

    key_id: str
    fingerprint: str
    edge_id: str
    sandbox_id: str | None


def key_id(claim: IdempotencyClaim) -> str:
    """The key as the cluster and its edges store it: scoped, fixed length, and in the
    edge's key alphabet (hex)."""
    return hashlib.sha256(f"{claim.scope}\n{claim.key}".encode()).hexdigest()


def _pin(row: KeyPinRow) -> KeyPin:
    return KeyPin(row.key_id, row.fingerprint, row.edge_id, row.sandbox_id)


class KeyPins:
    """The pins, one short transaction each."""

    def __init__(self, engine: AsyncEngine, *, ttl: float = KEY_TTL) -> None:
        self._sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self.ttl = ttl

    async def find(self, claim: IdempotencyClaim) -> KeyPin | None:
        """The live pin of ``claim``'s key; 409 if it was made with another spec."""
        async with self._sessions() as s:
            row = await s.get(KeyPinRow, key_id(claim))
        if row is None or row.expires_at <= time.time():
            return None
        if row.fingerprint != claim.fingerprint:
            raise IdempotencyKeyReused(
                f"{IDEMPOTENCY_HEADER} {claim.key!r} was used for a create with another spec",
                header=IDEMPOTENCY_HEADER,
            )
        return _pin(row)

    async def pin(self, claim: IdempotencyClaim, edge_id: str) -> KeyPin:
        """Pin the key to ``edge_id`` unless it is pinned already; the pin that holds."""
        kid = key_id(claim)
        async with self._sessions() as s, s.begin():
            # An expired pin is not a pin: clear it so that the insert can take its place.
            await s.execute(
                delete(KeyPinRow).where(
                    KeyPinRow.key_id == kid, KeyPinRow.expires_at <= time.time()
                )
            )
        try:
            async with self._sessions() as s, s.begin():
                s.add(
                    KeyPinRow(
                        key_id=kid,
                        fingerprint=claim.fingerprint,
                        edge_id=edge_id,
                        sandbox_id=None,
                        expires_at=time.time() + self.ttl,
                    )
                )
        except IntegrityError:
            pass  # another apiserver pinned it first: use theirs
        found = await self.find(claim)
        if found is None:  # expired between the two transactions: vanishingly rare
            return await self.pin(claim, edge_id)
        return found

    async def bind(self, pin: KeyPin, sandbox_id: str) -> None:
        """Record what the pinned create made (replays then need no edge)."""
        async with self._sessions() as s, s.begin():
            await s.execute(
                update(KeyPinRow)
                .where(KeyPinRow.key_id == pin.key_id, KeyPinRow.edge_id == pin.edge_id)
                .values(sandbox_id=sandbox_id)
            )

    async def unpin(self, pin: KeyPin) -> None:
        """Give a pin back when its edge made nothing (it refused, or it is down and no
        sandbox was recorded); a pin another request moved meanwhile is left alone."""
        async with self._sessions() as s, s.begin():
            await s.execute(
                delete(KeyPinRow).where(
                    KeyPinRow.key_id == pin.key_id,
                    KeyPinRow.edge_id == pin.edge_id,
                    KeyPinRow.sandbox_id.is_(None),
                )
            )

    async def prune(self) -> int:
        async with self._sessions() as s, s.begin():
            res = await s.execute(delete(KeyPinRow).where(KeyPinRow.expires_at <= time.time()))
        return int(getattr(res, "rowcount", 0) or 0)
