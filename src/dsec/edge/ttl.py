"""Idle TTL clocks that survive a restart of the edge.

The reaper compares ``rec.last_activity`` (monotonic, in memory) with the spec's
``ttl_running_stop``. Without a durable copy a restarted edge could only reset the
clock to "now", so a sandbox idle for 59 of its 60 minutes got another full hour
(up to the downtime late, and a crash loop kept it forever).

What is stored is the *idle deadline*: the unix time at which the TTL fires if
nothing else happens. Writing it on every exec would put a database write on the
hot path; instead it is written when activity has moved it by more than a coarse
``step`` (a twentieth of the TTL, 1 s to 60 s), and then with ``step`` added, so the
stored deadline is never earlier than the real one: after a crash the sandbox is
stopped at most ``step`` late, never early. A clean shutdown writes exact deadlines.
The record's last change of state (it became running, or was thawed after a job
pause, which does not go through ``touch``) counts as activity as well.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from dsec.backends.base import SandboxRecord
from dsec.edge.state import EdgeStateDB

MIN_STEP = 1.0
MAX_STEP = 60.0


def step_for(ttl: float) -> float:
    """How far activity may move the deadline before it is written again."""
    return min(max(ttl / 20, MIN_STEP), MAX_STEP)


def _wall(mono: float) -> float:
    return time.time() - (time.monotonic() - mono)


def _mono(wall: float) -> float:
    return time.monotonic() - (time.time() - wall)


class IdleClocks:
    def __init__(self, state: EdgeStateDB) -> None:
        self.state = state
        # sandbox id -> the monotonic activity time the stored deadline covers
        self._covered: dict[str, float] = {}

    def touch(self, rec: SandboxRecord) -> None:
        """``rec`` was used just now (the data path calls this on every request)."""
        now = time.monotonic()
        rec.last_activity = now
        ttl = rec.spec.ttl_running_stop
        if ttl is None or now <= self._covered.get(rec.id, 0.0):
            return
        step = step_for(ttl)
        # Covers activity up to now + step without another write.
        self._covered[rec.id] = now + step
        self.state.save_idle_deadlines([(rec.id, _wall(now) + step + ttl)])

    def started(self, rec: SandboxRecord) -> None:
        """A new running sandbox: its start (``updated_at``) stands in for a write."""
        ttl = rec.spec.ttl_running_stop
        if ttl is not None:
            self._covered[rec.id] = rec.last_activity + step_for(ttl)

    def restore(self, records: Iterable[SandboxRecord]) -> None:
        """Set the clocks of re-adopted sandboxes from their stored deadlines."""
        stored = self.state.load_idle_deadlines()
        for rec in records:
            ttl = rec.spec.ttl_running_stop
            if ttl is None:
                continue
            # The last change of state counts as activity too (it became running, or
            # was thawed: paused time never counts), written or not.
            since_change = rec.updated_at.timestamp() + step_for(ttl) + ttl
            deadline = max(stored.get(rec.id, since_change), since_change)
            rec.last_activity = _mono(deadline - ttl)
            self._covered[rec.id] = rec.last_activity

    def flush(self, records: list[SandboxRecord]) -> None:
        """Write exact deadlines (a clean shutdown: no activity can follow)."""
        rows = [
            (rec.id, _wall(rec.last_activity) + rec.spec.ttl_running_stop)
            for rec in records
            if rec.spec.ttl_running_stop is not None
        ]
        self.state.save_idle_deadlines(rows)
        for rec in records:
            self._covered.pop(rec.id, None)

    def forget(self, sandbox_id: str) -> None:
        self._covered.pop(sandbox_id, None)
