"""/v1/layers: the layer registry (build, tag, push, pull, list, remove) and the host cache."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.responses import Response

from dsec.api.layers import BuildLayerRequest, LayerInfo, LayerTransferRequest, TagLayerRequest
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.images.layers import LayerService


def _list(items: list[LayerInfo]) -> Response:
    body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
    return Response(body, media_type="application/json")


def layer_router(layers: LayerService, auth: Authenticator) -> APIRouter:
    router = APIRouter(
        tags=["layers"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.get("/v1/layers", response_model=list[LayerInfo], summary="List layers")
    async def list_layers() -> Response:
        return _list(await layers.list())

    @router.post("/v1/layers/build", response_model=LayerInfo, summary="Build a layer")
    async def build_layer(body: BuildLayerRequest) -> Response:
        """From a directory, a tar or a git checkout on the platform's host."""
        return model_response(await layers.build(body))

    @router.post("/v1/layers/tag", response_model=LayerInfo, summary="Tag a layer")
    async def tag_layer(body: TagLayerRequest) -> Response:
        return model_response(await layers.tag(body.source, body.target))

    @router.post("/v1/layers/push", response_model=LayerInfo, summary="Push to the store")
    async def push_layer(body: LayerTransferRequest) -> Response:
        return model_response(await layers.push(body.ref))

    @router.post("/v1/layers/pull", response_model=LayerInfo, summary="Pull from the store")
    async def pull_layer(body: LayerTransferRequest) -> Response:
        return model_response(await layers.pull(body.ref, blob=body.blob))

    @router.get("/v1/layer-cache", summary="Host layer cache and lazy loader counters")
    async def layer_cache() -> dict[str, Any]:
        return layers.cache_report()

    @router.get("/v1/layers/{ref}", response_model=LayerInfo, summary="Inspect a layer")
    async def get_layer(ref: str) -> Response:
        return model_response(await layers.get(ref))

    @router.delete("/v1/layers/{ref}", response_model=LayerInfo, summary="Remove a layer tag")
    async def remove_layer(ref: str) -> Response:
        return model_response(await layers.remove(ref))

    return router
