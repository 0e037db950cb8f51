"""Cluster methods of the SDK clients: which edges there are and how they are."""

from __future__ import annotations

from typing import Protocol, TypeVar

from dsec.api.cluster import EdgeStatus
from dsec.sdk._protocol import Call, _list_of

T = TypeVar("T")


def _edges() -> Call[list[EdgeStatus]]:
    return Call("GET", "/v1/cluster/edges", _list_of(EdgeStatus))


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class ClusterMixin:
    async def edges(self: _AsyncSender) -> list[EdgeStatus]:
        """The cluster's edges: status, last heartbeat, capacity and usage (cluster mode)."""
        return await self._send(_edges())


class SyncClusterMixin:
    def edges(self: _SyncSender) -> list[EdgeStatus]:
        return self._send(_edges())
