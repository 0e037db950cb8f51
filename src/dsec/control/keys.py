"""API keys: who may call the apiserver.

Only a SHA-256 hash of each key is stored, so a leaked database does not leak working
keys. Verified keys are cached in memory because every request is authenticated and
the exec path must not touch the database (latency target ~2 ms end to end).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from datetime import UTC, datetime

from sqlalchemy import DateTime, String, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from dsec.control.db import Base
from dsec.errors import InvalidArgument, Unauthenticated

KEY_PREFIX = "dsk_"
MAX_KEY_LENGTH = 512
MAX_PRINCIPAL_LENGTH = 128


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    principal: Mapped[str] = mapped_column(String(MAX_PRINCIPAL_LENGTH), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    """A fresh random key; the prefix makes keys easy to spot in logs and secret scanners."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_LENGTH or any(c.isspace() for c in key):
        raise InvalidArgument(
            f"an API key must be 1..{MAX_KEY_LENGTH} characters without whitespace"
        )


def _check_principal(principal: str) -> None:
    if not principal or len(principal) > MAX_PRINCIPAL_LENGTH or "\x00" in principal:
        raise InvalidArgument(f"a principal must be 1..{MAX_PRINCIPAL_LENGTH} characters")


class KeyStore:
    """API keys in the control database, with an in-memory cache of verified keys.

    A cached positive answer lives ``cache_ttl`` seconds so that a key revoked by another
    apiserver process stops working within that bound; a revocation made through this
    instance takes effect at once. Unknown keys are remembered briefly (``negative_ttl``)
    so a flood of garbage credentials cannot turn into a flood of database queries.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        cache_ttl: float = 60.0,
        negative_ttl: float = 2.0,
        negative_cache_size: int = 10_000,
    ) -> None:
        self._sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self._cache_ttl = cache_ttl
        self._negative_ttl = negative_ttl
        self._negative_cache_size = negative_cache_size
        self._known: dict[str, tuple[str, float]] = {}
        self._unknown: dict[str, float] = {}

    async def ensure(self, key: str, principal: str = "admin") -> None:
        """Make ``key`` valid for ``principal``; idempotent (used for the bootstrap key)."""
        _check_key(key)
        _check_principal(principal)
        digest = hash_key(key)
        async with self._sessions() as session:
            row = await session.get(ApiKeyRow, digest)
            if row is None:
                session.add(ApiKeyRow(key_hash=digest, principal=principal, created_at=_now()))
            elif row.principal != principal:
                row.principal = principal
            else:
                self._remember(digest, principal)
                return
            try:
                await session.commit()
            except IntegrityError:
                # A concurrent ensure() inserted the same key first: that is the goal.
                await session.rollback()
        self._remember(digest, principal)

    async def create(self, principal: str) -> str:
        """A new random key for ``principal``. The plain key is returned once, never stored."""
        _check_principal(principal)
        key = new_key()
        digest = hash_key(key)
        async with self._sessions() as session:
            session.add(ApiKeyRow(key_hash=digest, principal=principal, created_at=_now()))
            await session.commit()
        self._remember(digest, principal)
        return key

    async def verify(self, key: str) -> str:
        """The principal owning ``key``; raises Unauthenticated for unknown or revoked keys."""
        if not key or len(key) > MAX_KEY_LENGTH:
            raise Unauthenticated("unknown or revoked API key")
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._known.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        miss_until = self._unknown.get(digest)
        if miss_until is not None and miss_until > now:
            raise Unauthenticated("unknown or revoked API key")
        async with self._sessions() as session:
            row = await session.get(ApiKeyRow, digest)
        if row is None:
            self._known.pop(digest, None)
            if len(self._unknown) >= self._negative_cache_size:
                self._unknown.clear()
            self._unknown[digest] = now + self._negative_ttl
            raise Unauthenticated("unknown or revoked API key")
        self._remember(digest, row.principal)
        return row.principal

    async def revoke(self, key: str) -> bool:
        """Forget ``key``; True if it existed. Idempotent."""
        digest = hash_key(key)
        self._known.pop(digest, None)
        async with self._sessions() as session:
            result = await session.execute(delete(ApiKeyRow).where(ApiKeyRow.key_hash == digest))
            await session.commit()
        return bool(getattr(result, "rowcount", 0))

    async def revoke_digest(self, digest: str) -> bool:
        """Forget the key whose hash is ``digest`` (keys are listed by hash, never in
        plain); True if it existed."""
        self._known.pop(digest, None)
        async with self._sessions() as session:
            result = await session.execute(delete(ApiKeyRow).where(ApiKeyRow.key_hash == digest))
            await session.commit()
        return bool(getattr(result, "rowcount", 0))

    async def principals(self) -> list[tuple[str, datetime]]:
        """(principal, created_at) of every stored key, oldest first; for admin listings."""
        async with self._sessions() as session:
            rows = await session.execute(
                select(ApiKeyRow.principal, ApiKeyRow.created_at).order_by(ApiKeyRow.created_at)
            )
            return [(p, c) for p, c in rows.all()]

    def _remember(self, digest: str, principal: str) -> None:
        self._unknown.pop(digest, None)
        self._known[digest] = (principal, time.monotonic() + self._cache_ttl)


def _now() -> datetime:
    return datetime.now(UTC)
