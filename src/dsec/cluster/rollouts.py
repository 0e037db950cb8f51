"""Hosted rollouts through a cluster apiserver: made here, run on an edge.

A rollout lives on one edge: its worker, its agent sandbox, the model gateway its
scaffold calls and its durable row (dsec.rollouts). The apiserver

* makes the agent sandbox itself, through the one create path (authorised, charged to
  the project's quota, placed, entered in the cluster's directory: a sandbox an edge
  made on its own would be stopped as an orphan), then asks that sandbox's edge to
  start the rollout in it; a refusal there stops the sandbox again;
* routes a rollout by its id, which starts with its edge's id as a sandbox id does
  (durable: nothing to look up, any apiserver routes any rollout);
* fans a job's questions out to the edges that are up and merges the answers (a job's
  rollouts span edges): list, the finished hand-off (an edge that does not answer
  leaves its rollouts for the next read: none lost, none twice); ``ack`` goes to each
  id's own edge; ``set_endpoint`` to every edge that is up (each keeps the job's
  endpoint for the rollouts it holds and the ones it will get).

Authorisation is the apiserver's (dsec.apiserver.rollouts with dsec.control.jobs); the
edges trust it (the cluster token).
"""

from __future__ import annotations

import asyncio
import builtins
from datetime import UTC, datetime

from pydantic import TypeAdapter

from dsec.api.rollouts import (
    AckResult,
    EndpointSet,
    ModelEndpoint,
    RolloutInfo,
    RolloutResult,
    RolloutSpec,
    RolloutState,
)
from dsec.apiserver.creator import SandboxCreator
from dsec.cluster.fanout import Edges
from dsec.cluster.registry import DOWN
from dsec.cluster.remote import RemoteEdge
from dsec.cluster.router import ClusterEdge, edge_of
from dsec.errors import EdgeUnavailable, InvalidArgument, NotFound, SandboxNotFound
from dsec.rollouts.manager import SANDBOX_CREATE_TIMEOUT, WAIT_MAX, agent_sandbox

_infos: TypeAdapter[list[RolloutInfo]] = TypeAdapter(list[RolloutInfo])
_results: TypeAdapter[list[RolloutResult]] = TypeAdapter(list[RolloutResult])
_EPOCH = datetime.fromtimestamp(0, UTC)


class ClusterRollouts:
    """dsec.apiserver.rollouts.Rollouts over a cluster's edges."""

    def __init__(self, router: ClusterEdge, creator: SandboxCreator) -> None:
        self.router = router
        self.creator = creator
        self.edges = Edges(router)

    async def _remote(self, rollout_id: str) -> RemoteEdge:
        try:
            status, remote = await self.router.status_of(rollout_id)
        except SandboxNotFound:
            raise NotFound(f"no rollout {rollout_id!r}", rollout_id=rollout_id) from None
        if status.status == DOWN or remote is None:
            raise EdgeUnavailable(
                f"edge {status.edge_id}, which holds rollout {rollout_id}, is down "
                f"({status.down_reason or 'marked down'}); the rollout goes on when it is back",
                edge=status.edge_id,
            )
        return remote

    async def start(self, principal: str, spec: RolloutSpec, sandbox_id: str | None) -> RolloutInfo:
        if sandbox_id is not None:
            raise InvalidArgument("sandbox_id is for an apiserver calling its edge")
        info = await self.creator.create(
            principal, agent_sandbox(spec, spec.rollout_id), timeout=SANDBOX_CREATE_TIMEOUT
        )
        try:
            remote = await self.router.remote_of(info.id)
            resp = await remote.forward(
                "POST",
                "/v1/rollouts",
                params={"sandbox_id": info.id},
                json=spec.model_dump(mode="json"),
            )
        except BaseException:
            await asyncio.shield(self.creator.stop(principal, info.id))
            raise
        return RolloutInfo.model_validate_json(resp.content)

    async def get(self, rollout_id: str) -> RolloutInfo:
        remote = await self._remote(rollout_id)
        resp = await remote.forward("GET", f"/v1/rollouts/{rollout_id}")
        return RolloutInfo.model_validate_json(resp.content)

    async def wait(self, rollout_id: str, timeout: float) -> RolloutInfo:
        remote = await self._remote(rollout_id)
        resp = await remote.forward(
            "POST",
            f"/v1/rollouts/{rollout_id}/wait",
            params={"timeout": timeout},
            timeout=min(timeout, WAIT_MAX) + 30,
        )
        return RolloutInfo.model_validate_json(resp.content)

    async def cancel(self, principal: str, rollout_id: str) -> RolloutInfo:
        remote = await self._remote(rollout_id)
        resp = await remote.forward("POST", f"/v1/rollouts/{rollout_id}/cancel", timeout=120)
        return RolloutInfo.model_validate_json(resp.content)

    async def of_job(self, job_id: str, state: RolloutState | None) -> builtins.list[RolloutInfo]:
        params = {"job_id": job_id, **({"state": state.value} if state else {})}

        async def one(remote: RemoteEdge) -> builtins.list[RolloutInfo]:
            resp = await self.edges.ask(remote, "GET", "/v1/rollouts", params=params)
            return _infos.validate_json(resp.content)

        found, _missing = await self.edges.gather(one)
        items = [i for part in found.values() for i in part]
        return sorted(items, key=lambda i: (i.created_at, i.id))

    async def finished(self, job_id: str, limit: int) -> builtins.list[RolloutResult]:
        path = f"/v1/jobs/{job_id}/rollouts/finished"

        async def one(remote: RemoteEdge) -> builtins.list[RolloutResult]:
            resp = await self.edges.ask(remote, "GET", path, params={"limit": limit})
            return _results.validate_json(resp.content)

        found, _missing = await self.edges.gather(one)
        items = [r for part in found.values() for r in part]
        items.sort(key=lambda r: (r.rollout.finished_at or _EPOCH, r.rollout.id))
        return items[:limit]

    async def ack(self, job_id: str, ids: builtins.list[str]) -> AckResult:
        """Each id to its own edge (one transaction there); ids of no edge: unknown. An
        edge that does not answer: 503 (acking again is safe: ``already``)."""
        by_edge: dict[str, builtins.list[str]] = {}
        for rid in dict.fromkeys(ids):
            by_edge.setdefault(edge_of(rid), []).append(rid)
        out = AckResult(acked=[], already=[], unknown=[])
        path = f"/v1/jobs/{job_id}/rollouts/ack"
        for part in by_edge.values():
            try:
                remote = await self._remote(part[0])
            except NotFound:
                out.unknown.extend(part)
                continue
            resp = await remote.forward("POST", path, json={"ids": part})
            got = AckResult.model_validate_json(resp.content)
            out.acked += got.acked
            out.already += got.already
            out.unknown += got.unknown
        return out

    async def set_endpoint(self, job_id: str, endpoint: ModelEndpoint) -> EndpointSet:
        """On every edge that is up; one that is up and does not answer: 503 after the
        others took it (setting again is safe). A down edge is not asked: its rollouts
        are stopped there; set the endpoint again once it is back."""
        path = f"/v1/jobs/{job_id}/model-endpoint"
        body = endpoint.model_dump(mode="json")

        async def one(remote: RemoteEdge) -> EndpointSet:
            resp = await self.edges.ask(remote, "PUT", path, json=body)
            return EndpointSet.model_validate_json(resp.content)

        found, missing = await self.edges.gather(one)
        down = {s.edge_id for s, _ in self.router.members() if s.status == DOWN}
        silent = sorted(set(missing) - down)
        if silent:
            raise EdgeUnavailable(
                f"edges {', '.join(silent)} did not take job {job_id}'s endpoint (the others "
                "did); set it again",
                edges=silent,
            )
        return EndpointSet(
            job_id=job_id,
            endpoint=endpoint.public(),
            rollouts=sum(s.rollouts for s in found.values()),
        )
