"""Idempotent creates: an ``Idempotency-Key`` maps to the one sandbox it made.

A client that lost the answer to a create (a timeout, a dropped connection, a crash
of its own) cannot tell whether the sandbox exists; retrying blindly makes two. With
a key, the retry gets the first one's sandbox (whatever its state) and a create is
made at most once per key:

- the key row is written in the same transaction as the sandbox's first record
  (``EdgeStateDB.save(rec, key=...)``), before the create is acknowledged, so it
  survives a crash like the record does;
- a retry while the first create is still in flight waits for it (in memory: the
  pending creates of this process); a create whose requester went away runs on, so
  the retry adopts it;
- a create that *failed* (or was cut short by a restart of the edge) gives its key
  back: there is no sandbox to return, and the retry tries again;
- the same key with another spec is ``IdempotencyKeyReused`` (409); keys are scoped
  (the API principal and project), so two tenants never see each other's;
- keys expire (``KEY_TTL``, 24 h by default) and are deleted by the edge's reaper.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass

from dsec.api.sandbox import IDEMPOTENCY_HEADER, IDEMPOTENCY_KEY_RE
from dsec.api.spec import RunArgs
from dsec.edge.state import EdgeStateDB, KeyRow
from dsec.errors import IdempotencyKeyReused, InvalidArgument

KEY_TTL = 24 * 3600.0


def check_key(key: str) -> str:
    """A key the edge stores (422 otherwise): 1-255 of ``A-Za-z0-9._:~+/=-``."""
    if not IDEMPOTENCY_KEY_RE.match(key):
        raise InvalidArgument(
            f"{IDEMPOTENCY_HEADER} must be 1-255 characters of A-Z a-z 0-9 . _ : ~ + / = -"
            f" (got {len(key)} characters)",
            header=IDEMPOTENCY_HEADER,
        )
    return key


def fingerprint(spec: RunArgs) -> str:
    """What "the same spec" means: the full spec, defaults filled in, keys sorted."""
    canon = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass(frozen=True)
class IdempotencyClaim:
    """A keyed create as the apiserver hands it to the edge."""

    scope: str  # who sent it: principal and project
    key: str
    fingerprint: str

    @classmethod
    def of(cls, scope: str, key: str, spec: RunArgs) -> IdempotencyClaim:
        return cls(scope, check_key(key), fingerprint(spec))


class IdempotencyKeys:
    """The edge's keys: durable rows in its state DB, creates in flight in memory."""

    def __init__(self, state: EdgeStateDB, *, ttl: float = KEY_TTL) -> None:
        self.state = state
        self.ttl = ttl
        # (scope, key) -> (fingerprint, done): done resolves to the sandbox id, or None
        # when the create failed (the key is free again).
        self._pending: dict[tuple[str, str], tuple[str, asyncio.Future[str | None]]] = {}
        self._next_expiry = 0.0

    def _check(self, claim: IdempotencyClaim, fp: str) -> None:
        if fp != claim.fingerprint:
            raise IdempotencyKeyReused(
                f"{IDEMPOTENCY_HEADER} {claim.key!r} was used for a create with another spec",
                key=claim.key,
            )

    def find(self, claim: IdempotencyClaim) -> str | asyncio.Future[str | None] | None:
        """The sandbox id the key made, the pending create's future, or None (unused).
        IdempotencyKeyReused if the key went with another spec."""
        pending = self._pending.get((claim.scope, claim.key))
        if pending is not None:
            self._check(claim, pending[0])
            return pending[1]
        row = self.state.find_key(claim.scope, claim.key, time.time())
        if row is None:
            return None
        self._check(claim, row.fingerprint)
        return row.sandbox_id

    def begin(self, claim: IdempotencyClaim) -> None:
        """Mark the key in flight (synchronously after ``find`` said it is unused)."""
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._pending[(claim.scope, claim.key)] = (claim.fingerprint, done)

    def row(self, claim: IdempotencyClaim, sandbox_id: str) -> KeyRow:
        """The row to write with the sandbox's first record."""
        return KeyRow(claim.scope, claim.key, claim.fingerprint, sandbox_id, time.time() + self.ttl)

    def end(self, claim: IdempotencyClaim, sandbox_id: str | None) -> None:
        """The create ran (``sandbox_id``) or failed (None: the key is given back)."""
        pending = self._pending.pop((claim.scope, claim.key), None)
        if sandbox_id is None:
            self.state.delete_key(claim.scope, claim.key)
        if pending is not None and not pending[1].done():
            pending[1].set_result(sandbox_id)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """A create cut short by a restart made no sandbox: its key is free again."""
        self.state.delete_keys_of(sandbox_id)

    def expire(self, every: float = 60.0) -> None:
        """Delete expired keys, at most once per ``every`` seconds (the reaper's pass)."""
        now = time.time()
        if now >= self._next_expiry:
            self._next_expiry = now + every
            self.state.delete_expired_keys(now)
