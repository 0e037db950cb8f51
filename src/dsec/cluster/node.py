"""An edge's side of cluster membership: join, heartbeat, reconcile.

The edge serves its own API (the `dsec up` app, authenticated by the cluster token)
and beats to an apiserver every second with its capacity, usage, cached images and
layers, and the sandboxes that ended since the last acknowledged beat. Its first beat
after a start carries every live sandbox, so that the cluster re-adopts what survived
and tells it to stop what the cluster no longer knows. Beats go to the first apiserver
of ``join`` that answers; an edge that cannot reach any keeps serving its sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import httpx

from dsec.api.cluster import EdgeReport, HeartbeatReply
from dsec.api.sandbox import SandboxState
from dsec.edge.edge import Edge
from dsec.errors import DSecError
from dsec.images.images import Images

log = logging.getLogger(__name__)

HEARTBEAT_PATH = "/v1/cluster/heartbeat"
FULL_EVERY = 30  # beats between full live lists (orphans of lost create answers)
LIVE = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED)


class EdgeNode:
    def __init__(
        self,
        edge: Edge,
        images: Images,
        *,
        join: list[str],
        token: str,
        url: str,
        labels: dict[str, str] | None = None,
        lazy: bool = False,
        interval: float = 0.5,
    ) -> None:
        self.edge = edge
        self.images = images
        self.join = [j.rstrip("/") for j in join]
        self.url = url
        self.labels = dict(labels or {})
        self.lazy = lazy
        self.interval = interval
        self.incarnation = f"{int(time.time())}-{secrets.token_hex(4)}"
        self._token = token
        self._ended: dict[str, str] = {}
        self._send_live = True
        self._beats = 0
        edge.add_stop_listener(self._on_stop)

    def _on_stop(self, sandbox_id: str, reason: str) -> None:
        self._ended[sandbox_id] = reason

    async def report(self) -> EdgeReport:
        records = await self.edge.list(states=set(LIVE))
        images = await self.images.list()
        admission = self.edge.admission
        live = None
        if self._send_live or self._beats % FULL_EVERY == 0:
            now = time.time()
            live = {r.id: max(0.0, now - r.created_at.timestamp()) for r in records}
        return EdgeReport(
            edge_id=self.edge.edge_id,
            url=self.url,
            incarnation=self.incarnation,
            capacity=admission.max_sandboxes,
            sandboxes=admission.count,
            # CPU is shared, not admitted (a sandbox's cores are a quota, not a
            # reservation): 0 tells placement not to filter or score by it.
            cpu_cores=0.0,
            cpu_committed=sum(r.spec.cpu_cores_limit for r in records),
            memory_mb=admission.memory_budget_mb,
            memory_committed_mb=admission.memory_mb,
            backends=["container"],
            labels=self.labels,
            images=sorted({i.ref for i in images}),
            layers=sorted({d for i in images for d in i.layers}),
            lazy=self.lazy,
            load_seq=admission.seq,  # read with count and memory: no await in between
            live=live,
            ended=dict(self._ended),
        )

    async def beat(self, http: httpx.AsyncClient) -> HeartbeatReply:
        """One heartbeat to the first apiserver that takes it."""
        report = await self.report()
        body = report.model_dump(mode="json")
        last: Exception | None = None
        for base in self.join:
            try:
                resp = await http.post(base + HEARTBEAT_PATH, json=body)
            except httpx.HTTPError as exc:
                last = exc
                continue
            if resp.status_code != 200:
                last = RuntimeError(f"{base} answered {resp.status_code}: {resp.text[:300]}")
                continue
            reply = HeartbeatReply.model_validate_json(resp.content)
            for sid in report.ended:
                self._ended.pop(sid, None)  # acknowledged
            if report.live is not None:
                self._send_live = False
            self._send_live = self._send_live or reply.want_live
            self._beats += 1
            for sid in reply.stop:
                with contextlib.suppress(DSecError):
                    await self.edge.stop(sid, reason="the cluster no longer knows it")
            return reply
        raise ConnectionError(f"no apiserver of {self.join} took the heartbeat: {last}")

    async def run(self) -> None:
        """Beat until cancelled; failures are logged and retried, never fatal."""
        headers = {"Authorization": f"Bearer {self._token}", "User-Agent": "dsec-edge"}
        async with httpx.AsyncClient(headers=headers, timeout=5.0) as http:
            failures = 0
            while True:
                wait = self.interval
                try:
                    wait = (await self.beat(http)).interval
                    if failures:
                        log.warning("edge %s: heartbeats go through again", self.edge.edge_id)
                    failures = 0
                except (ConnectionError, DSecError, ValueError) as exc:
                    failures += 1
                    if failures in (1, 10) or failures % 60 == 0:
                        log.warning("edge %s: heartbeat failed: %s", self.edge.edge_id, exc)
                await asyncio.sleep(wait)
