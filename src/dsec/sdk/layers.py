"""Layer methods of the SDK clients (``DSecClient`` / ``DSecSyncClient`` inherit them).

Layers are versioned on their own and stacked at sandbox start::

    await client.build_layer("task-repo:v3", "git", "/src/task-repo", prefix="/workspace")
    sb = await client.run_container(DSecContainerRunArgs(
        container_image="debian-python:bookworm", workspace=LayerRef("task-repo", "v3")))
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from dsec.api.layers import LayerInfo, LayerKind
from dsec.sdk import _layers as proto
from dsec.sdk._protocol import Call

T = TypeVar("T")


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class LayersMixin:
    async def list_layers(self: _AsyncSender) -> list[LayerInfo]:
        return await self._send(proto.list_layers())

    async def get_layer(self: _AsyncSender, ref: str) -> LayerInfo:
        return await self._send(proto.get_layer(ref))

    async def build_layer(
        self: _AsyncSender,
        ref: str,
        source: str,
        path: str,
        *,
        rev: str | None = None,
        prefix: str = "/",
        kind: LayerKind = "workspace",
        timeout: float | None = None,
    ) -> LayerInfo:
        """Build ``name:version`` from a directory, tar or git checkout on the platform host."""
        call = proto.build_layer(
            ref, source, path, rev=rev, prefix=prefix, kind=kind, timeout=timeout
        )
        return await self._send(call)

    async def tag_layer(self: _AsyncSender, source: str, target: str) -> LayerInfo:
        return await self._send(proto.tag_layer(source, target))

    async def push_layer(
        self: _AsyncSender, ref: str, *, timeout: float | None = None
    ) -> LayerInfo:
        return await self._send(proto.push_layer(ref, timeout))

    async def pull_layer(
        self: _AsyncSender, ref: str, *, blob: bool = True, timeout: float | None = None
    ) -> LayerInfo:
        return await self._send(proto.pull_layer(ref, blob=blob, timeout=timeout))

    async def remove_layer(self: _AsyncSender, ref: str) -> LayerInfo:
        return await self._send(proto.remove_layer(ref))

    async def layer_cache(self: _AsyncSender) -> dict[str, Any]:
        """Host cache usage and the lazy loader's counters (bytes fetched, verified...)."""
        return await self._send(proto.layer_cache())


class SyncLayersMixin:
    def list_layers(self: _SyncSender) -> list[LayerInfo]:
        return self._send(proto.list_layers())

    def get_layer(self: _SyncSender, ref: str) -> LayerInfo:
        return self._send(proto.get_layer(ref))

    def build_layer(
        self: _SyncSender,
        ref: str,
        source: str,
        path: str,
        *,
        rev: str | None = None,
        prefix: str = "/",
        kind: LayerKind = "workspace",
        timeout: float | None = None,
    ) -> LayerInfo:
        call = proto.build_layer(
            ref, source, path, rev=rev, prefix=prefix, kind=kind, timeout=timeout
        )
        return self._send(call)

    def tag_layer(self: _SyncSender, source: str, target: str) -> LayerInfo:
        return self._send(proto.tag_layer(source, target))

    def push_layer(self: _SyncSender, ref: str, *, timeout: float | None = None) -> LayerInfo:
        return self._send(proto.push_layer(ref, timeout))

    def pull_layer(
        self: _SyncSender, ref: str, *, blob: bool = True, timeout: float | None = None
    ) -> LayerInfo:
        return self._send(proto.pull_layer(ref, blob=blob, timeout=timeout))

    def remove_layer(self: _SyncSender, ref: str) -> LayerInfo:
        return self._send(proto.remove_layer(ref))

    def layer_cache(self: _SyncSender) -> dict[str, Any]:
        return self._send(proto.layer_cache())
