"""Hosted rollouts on the clients (async and sync): the agent loop runs on the platform.

spec = RolloutSpec(job_id="job-7", sandbox=DSecContainerRunArgs(container_image=...),
                   scaffold="python3 /work/agent.py",
                   model=ModelEndpoint(base_url="http://trainer:8000/v1"),
                   reward=VerifyRequest(command="pytest -q /work/tests"))
ro = await client.start_rollout(spec)            # ro.id
await client.set_model_endpoint("job-7", ModelEndpoint(base_url=...))  # trainer moved
for done in await client.finished_rollouts("job-7"):
    train_on(done.steps, done.rollout.reward)
await client.ack_rollouts("job-7", [d.rollout.id for d in done_list])
"""

from __future__ import annotations

import time
from typing import Protocol, TypeVar

from dsec.api.rollouts import (
    AckResult,
    EndpointSet,
    ModelEndpoint,
    RolloutInfo,
    RolloutResult,
    RolloutSpec,
    RolloutState,
)
from dsec.errors import Timeout
from dsec.sdk import _rollouts as proto
from dsec.sdk._protocol import Call

T = TypeVar("T")


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


def _timed_out(info: RolloutInfo, timeout: float) -> Timeout:
    return Timeout(
        f"rollout {info.id} is still {info.state.value} after {timeout:g}s",
        rollout_id=info.id,
        state=info.state.value,
    )


class RolloutsMixin:
    async def start_rollout(self: _AsyncSender, spec: RolloutSpec) -> RolloutInfo:
        """Start a rollout on the platform (agent sandbox, scaffold, worker); returns at
        once with its ``id``. It goes on whatever happens to the caller."""
        return await self._send(proto.start_rollout(spec))

    async def get_rollout(self: _AsyncSender, rollout_id: str) -> RolloutInfo:
        return await self._send(proto.get_rollout(rollout_id))

    async def list_rollouts(
        self: _AsyncSender, job_id: str, state: RolloutState | str | None = None
    ) -> list[RolloutInfo]:
        return await self._send(proto.list_rollouts(job_id, state))

    async def wait_rollout(
        self: _AsyncSender, rollout_id: str, timeout: float = 3600.0
    ) -> RolloutInfo:
        """The rollout once finished, failed or cancelled; Timeout (504) if not by then."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            info = await self._send(proto.wait_rollout(rollout_id, max(0.1, left)))
            if info.state.terminal:
                return info
            if time.monotonic() >= deadline:
                raise _timed_out(info, timeout)

    async def cancel_rollout(self: _AsyncSender, rollout_id: str) -> RolloutInfo:
        return await self._send(proto.cancel_rollout(rollout_id))

    async def finished_rollouts(
        self: _AsyncSender, job_id: str, limit: int = 100
    ) -> list[RolloutResult]:
        """Ended rollouts of the job not acknowledged yet, with their trajectories."""
        return await self._send(proto.finished_rollouts(job_id, limit))

    async def ack_rollouts(self: _AsyncSender, job_id: str, ids: list[str]) -> AckResult:
        """Acknowledged rollouts are never handed out again."""
        return await self._send(proto.ack_rollouts(job_id, ids))

    async def set_model_endpoint(
        self: _AsyncSender, job_id: str, endpoint: ModelEndpoint
    ) -> EndpointSet:
        """Point the job's rollouts (held model calls included) at ``endpoint``."""
        return await self._send(proto.set_model_endpoint(job_id, endpoint))


class SyncRolloutsMixin:
    def start_rollout(self: _SyncSender, spec: RolloutSpec) -> RolloutInfo:
        return self._send(proto.start_rollout(spec))

    def get_rollout(self: _SyncSender, rollout_id: str) -> RolloutInfo:
        return self._send(proto.get_rollout(rollout_id))

    def list_rollouts(
        self: _SyncSender, job_id: str, state: RolloutState | str | None = None
    ) -> list[RolloutInfo]:
        return self._send(proto.list_rollouts(job_id, state))

    def wait_rollout(self: _SyncSender, rollout_id: str, timeout: float = 3600.0) -> RolloutInfo:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            info = self._send(proto.wait_rollout(rollout_id, max(0.1, left)))
            if info.state.terminal:
                return info
            if time.monotonic() >= deadline:
                raise _timed_out(info, timeout)

    def cancel_rollout(self: _SyncSender, rollout_id: str) -> RolloutInfo:
        return self._send(proto.cancel_rollout(rollout_id))

    def finished_rollouts(self: _SyncSender, job_id: str, limit: int = 100) -> list[RolloutResult]:
        return self._send(proto.finished_rollouts(job_id, limit))

    def ack_rollouts(self: _SyncSender, job_id: str, ids: list[str]) -> AckResult:
        return self._send(proto.ack_rollouts(job_id, ids))

    def set_model_endpoint(self: _SyncSender, job_id: str, endpoint: ModelEndpoint) -> EndpointSet:
        return self._send(proto.set_model_endpoint(job_id, endpoint))
