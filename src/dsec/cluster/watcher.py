"""The watcher: probes every edge and marks the ones that stopped answering down.

It keeps no durable state of its own: its only memory is how many probes in a row
each edge has failed, rebuilt from zero on a restart (the edges themselves and their
last heartbeats are in the database). An edge is marked down when ``failures`` probes
in a row failed *and* its last heartbeat is older than ``stale_after`` — both, so that
neither a slow probe nor a slow beat alone flaps an edge that is serving. Marking
down reports the edge's sandboxes ``lost`` and releases their quota
(dsec.cluster.registry); an edge that comes back re-registers by its next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from dsec.api.cluster import EdgeStatus
from dsec.cluster.registry import DOWN, Registry

log = logging.getLogger(__name__)


@dataclass
class Probe:
    failures: int = 0
    last_error: str = ""
    latency: float = 0.0


@dataclass
class Watcher:
    registry: Registry
    period: float = 1.0
    failures: int = 3
    stale_after: float = 5.0
    probe_timeout: float = 1.0
    prune_every: float = 600.0
    probes: dict[str, Probe] = field(default_factory=dict)

    async def probe(self, http: httpx.AsyncClient, status: EdgeStatus) -> None:
        probe = self.probes.setdefault(status.edge_id, Probe())
        start = time.perf_counter()
        try:
            resp = await http.get(status.url.rstrip("/") + "/v1/health")
            if resp.status_code != 200:
                raise httpx.HTTPStatusError(
                    f"health answered {resp.status_code}", request=resp.request, response=resp
                )
        except Exception as exc:  # any failure (a malformed URL too) is a failed probe
            probe.failures += 1
            probe.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return
        probe.failures, probe.last_error = 0, ""
        probe.latency = time.perf_counter() - start

    async def run_once(self, http: httpx.AsyncClient) -> list[str]:
        """Probe every edge once; returns the edges marked down by this round."""
        statuses = await self.registry.edges()
        known = {s.edge_id for s in statuses}
        for gone in set(self.probes) - known:
            del self.probes[gone]
        up = [s for s in statuses if s.status != DOWN]
        await asyncio.gather(*(self.probe(http, s) for s in up))
        now = time.time()
        downed: list[str] = []
        for status in up:
            probe = self.probes[status.edge_id]
            age = now - status.heartbeat_at
            if probe.failures >= self.failures and age > self.stale_after:
                reason = (
                    f"{probe.failures} probes failed ({probe.last_error}); "
                    f"last heartbeat {age:.1f} s ago"
                )
                lost = await self.registry.mark_down(status.edge_id, reason)
                log.warning(
                    "edge %s down, %d sandboxes lost: %s", status.edge_id, len(lost), reason
                )
                downed.append(status.edge_id)
        return downed

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.probe_timeout) as http:
            last_prune = time.monotonic()
            while True:
                try:
                    await self.run_once(http)
                    if time.monotonic() - last_prune > self.prune_every:
                        await self.registry.prune()
                        last_prune = time.monotonic()
                except Exception:  # the database may blink; the next round tries again
                    log.exception("watcher round failed")
                await asyncio.sleep(self.period)
