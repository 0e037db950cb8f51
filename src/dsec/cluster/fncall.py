"""FnCall through an apiserver: each call forwarded to one edge's warm pools.

A call is stateless, so any edge with the image can run it. The edge is chosen per call:
edges that have the image first (a lazy edge, on a shared layer store, has them all),
then the lowest ``calls this apiserver has in flight there - ready sandboxes of a
matching warm pool there`` (warm pools absorb calls until busy, then the load spreads),
ties broken at random. The pools view comes from the edges' ``/v1/fncall/pools``,
refreshed every second while FnCall is in use (every 5 s otherwise).

A call is tried on another edge only when it surely did not run: the edge could not be
reached (connection refused), did not have the image, or refused it before starting
(no sandbox became ready: AdmissionRejected). Once an edge accepted the request, a lost
connection or a timeout is the caller's answer: the call may have run, and it never
runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter

from dsec.api.fncall import (
    CallRequest,
    CallResult,
    DSecFnCallRunArgs,
    JudgeRequest,
    JudgeResult,
    LanguageInfo,
    PoolInfo,
    RunCodeRequest,
    RunCodeResult,
    WarmPoolRequest,
)
from dsec.backends.fncall.service import FnCallService
from dsec.cluster.fanout import Edges
from dsec.cluster.registry import DOWN
from dsec.cluster.remote import EdgeNotReached, RemoteEdge
from dsec.cluster.router import STALE_AFTER_S, ClusterEdge, image_key
from dsec.errors import AdmissionRejected, DSecError, EdgeUnavailable, ImageNotFound

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_pools = TypeAdapter(list[PoolInfo])

POOLS_PERIOD_S = 1.0
# ...while someone used FnCall this recently; else every POOLS_IDLE_PERIOD_S.
INTEREST_S = 60.0
POOLS_IDLE_PERIOD_S = 5.0
MAX_ATTEMPTS = 4
_SUMMED = ("ready", "starting", "in_use", "target", "created", "destroyed", "misses")


def _matches(pool: PoolInfo, args: DSecFnCallRunArgs) -> bool:
    return (
        pool.image == args.image
        and pool.memory_limit_mb == args.memory_limit_mb
        and math.isclose(pool.cpu_cores_limit, args.cpu_cores_limit)
    )


def _add(have: PoolInfo, info: PoolInfo) -> None:
    for name in _SUMMED:
        setattr(have, name, getattr(have, name) + getattr(info, name))
    if info.warm_s is not None:
        have.warm_s = max(have.warm_s or 0.0, info.warm_s)


def merge_pools(infos: Iterable[PoolInfo]) -> list[PoolInfo]:
    """One pool per key over the edges: the counts summed, the slowest warm time."""
    merged: dict[str, PoolInfo] = {}
    for info in infos:
        have = merged.get(info.key)
        if have is None:
            merged[info.key] = info.model_copy()
        else:
            _add(have, info)
    return [merged[k] for k in sorted(merged)]


class ClusterFnCall:
    """The FnCall service the apiserver's /v1/fncall routes call in cluster mode."""

    def __init__(self, router: ClusterEdge, *, timeout: float | None = None) -> None:
        self.router = router
        self.edges = Edges(router, timeout=timeout)
        self._pools: dict[str, list[PoolInfo]] = {}
        self._inflight: Counter[str] = Counter()
        self._interest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Keep the pools view: the first /v1/fncall/pools answer has it already."""
        self._task = asyncio.create_task(self._pools_loop(), name="dsec-fncall-pools")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the pools view -------------------------------------------------------------------
    def _touch(self) -> None:
        self._interest = time.monotonic()

    async def _pools_loop(self) -> None:
        while True:
            try:
                await self.refresh_pools()
            except Exception:  # an edge blinking must not end the loop
                log.exception("FnCall pools refresh failed")
            busy = time.monotonic() - self._interest < INTEREST_S
            await asyncio.sleep(POOLS_PERIOD_S if busy else POOLS_IDLE_PERIOD_S)

    async def refresh_pools(self) -> dict[str, str]:
        """Ask every up edge for its pools; returns the edges that did not answer."""

        async def one(remote: RemoteEdge) -> list[PoolInfo]:
            resp = await self.edges.ask(remote, "GET", "/v1/fncall/pools")
            return _pools.validate_json(resp.content)

        answers, missing = await self.edges.gather(one)
        for edge_id in missing:
            self._pools.pop(edge_id, None)
        for edge_id in set(self._pools) - set(answers) - set(missing):
            del self._pools[edge_id]  # gone from the cluster
        self._pools.update(answers)
        return missing

    def pools_info(self) -> list[PoolInfo]:
        """Every edge's pools as of the last refresh (<= ~1 s old while in use)."""
        self._touch()
        return merge_pools(p for pools in self._pools.values() for p in pools)

    @staticmethod
    def languages() -> list[LanguageInfo]:
        return FnCallService.languages()  # the same table on every edge of this version

    # -- placement ------------------------------------------------------------------------
    def candidates(self, args: DSecFnCallRunArgs) -> list[RemoteEdge]:
        """Up edges, best first (see the module docstring)."""
        now = time.time()
        want = image_key(args.image)
        scored: list[tuple[int, int, float, RemoteEdge]] = []
        for status, remote in self.router.members():
            edge_id = status.edge_id
            if remote is None or status.status == DOWN:
                continue
            if now - status.heartbeat_at > STALE_AFTER_S:
                continue
            report = status.report
            has_image = report.lazy or any(image_key(i) == want for i in report.images)
            ready = sum(p.ready for p in self._pools.get(edge_id, ()) if _matches(p, args))
            load = self._inflight[edge_id] - ready
            scored.append((0 if has_image else 1, load, random.random(), remote))
        scored.sort(key=lambda t: t[:3])
        return [t[3] for t in scored]

    async def _forward(
        self,
        args: DSecFnCallRunArgs,
        path: str,
        body: BaseModel,
        model: type[M],
        wait: float,
        *,
        single_sandbox: bool = True,
    ) -> M:
        """Send the call to the best edge; another edge only when it surely did not run.
        A refusal for want of room (AdmissionRejected) is such a sign only for a call
        that takes one sandbox before any of its code runs: a judge takes one per test,
        so by its refusal the compile and some tests may have run."""
        retry: tuple[type[DSecError], ...] = (EdgeNotReached, ImageNotFound)
        if single_sandbox:
            retry += (AdmissionRejected,)
        self._touch()
        candidates = self.candidates(args)[:MAX_ATTEMPTS]
        if not candidates:
            raise EdgeUnavailable("no edge of the cluster is up to run the call; retry later")
        refusals: list[dict[str, Any]] = []
        last: DSecError | None = None
        content = body.model_dump_json(exclude_unset=True)
        for remote in candidates:
            self._inflight[remote.edge_id] += 1
            try:
                resp = await remote.forward(
                    "POST",
                    path,
                    content=content,
                    headers={"Content-Type": "application/json"},
                    timeout=wait,
                )
            except retry as exc:
                # It surely did not run there: ask the next edge.
                refusals.append({"edge": remote.edge_id, "code": exc.code, "reason": exc.message})
                last = exc
                continue
            finally:
                self._inflight[remote.edge_id] -= 1
                if self._inflight[remote.edge_id] <= 0:
                    del self._inflight[remote.edge_id]
            return model.model_validate_json(resp.content)
        assert last is not None
        if all(r["code"] == last.code for r in refusals) and not isinstance(last, EdgeNotReached):
            last.details["refusals"] = refusals
            raise last
        raise EdgeUnavailable(
            f"no edge took the call ({len(refusals)} tried); retry later",
            refusals=refusals,
        )

    async def run_code(self, req: RunCodeRequest) -> RunCodeResult:
        wait = req.args.timeout_s + 60
        return await self._forward(req.args, "/v1/fncall/run", req, RunCodeResult, wait)

    async def judge(self, req: JudgeRequest) -> JudgeResult:
        # Tests may run one after another on the edge: each within its own limit.
        wait = min((req.args.timeout_s + 5) * len(req.tests) + 60, 4 * 3600.0)
        return await self._forward(
            req.args, "/v1/fncall/judge", req, JudgeResult, wait, single_sandbox=False
        )

    async def call(self, req: CallRequest) -> CallResult:
        wait = req.args.timeout_s + 60
        return await self._forward(req.args, "/v1/fncall/call", req, CallResult, wait)

    async def warm(self, req: WarmPoolRequest) -> PoolInfo:
        """``size`` ready sandboxes over the edges that have the image, split evenly
        (calls spread over them too); the answer sums their pools."""
        self._touch()
        want = image_key(req.args.image)
        remotes = [
            r
            for r in self.candidates(req.args)
            if (s := self.router.edge_status(r.edge_id)) is not None
            and (s.report.lazy or any(image_key(i) == want for i in s.report.images))
        ]
        if not remotes:
            raise ImageNotFound(
                f"no up edge has image {req.args.image!r}; build or import it on the edges"
            )
        share = math.ceil(req.size / len(remotes))
        body = req.model_copy(update={"size": share}).model_dump_json()
        wait = req.timeout_s + 30 if req.wait else 30.0
        results = await asyncio.gather(
            *(
                r.forward(
                    "POST",
                    "/v1/fncall/pools/warm",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=wait,
                )
                for r in remotes
            ),
            return_exceptions=True,
        )
        infos: list[PoolInfo] = []
        errors: list[BaseException] = []
        for remote, res in zip(remotes, results, strict=True):
            if isinstance(res, BaseException):
                log.warning("edge %s did not warm a pool: %s", remote.edge_id, res)
                errors.append(res)
            else:
                info = PoolInfo.model_validate_json(res.content)
                infos.append(info)
                pools = [p for p in self._pools.get(remote.edge_id, []) if p.key != info.key]
                self._pools[remote.edge_id] = [*pools, info]
        if not infos:
            raise errors[0]
        # One pool per edge (keys differ where an image was built apart): their sum.
        total = infos[0].model_copy()
        for info in infos[1:]:
            _add(total, info)
        return total
