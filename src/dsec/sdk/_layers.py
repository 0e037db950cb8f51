"""The layer part of the HTTP protocol (requests and parsers, no I/O), like _protocol."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from dsec.api.layers import (
    BuildLayerRequest,
    LayerInfo,
    LayerKind,
    LayerTransferRequest,
    TagLayerRequest,
    check_layer_name,
    check_layer_version,
)
from dsec.errors import InvalidArgument
from dsec.sdk._protocol import Call, _list_of, _model, invalid, wait_timeout

_JSON_HEADERS = {"Content-Type": "application/json"}


def _ref_path(ref: str) -> str:
    name, sep, version = ref.partition(":")
    try:
        check_layer_name(name)
        if sep:
            check_layer_version(version)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return "/v1/layers/" + quote(ref, safe=":")


def _post(path: str, body: Any, timeout: float | None = None) -> Call[LayerInfo]:
    return Call(
        "POST",
        path,
        _model(LayerInfo),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout),
    )


def list_layers() -> Call[list[LayerInfo]]:
    return Call("GET", "/v1/layers", _list_of(LayerInfo))


def get_layer(ref: str) -> Call[LayerInfo]:
    return Call("GET", _ref_path(ref), _model(LayerInfo))


def remove_layer(ref: str) -> Call[LayerInfo]:
    return Call("DELETE", _ref_path(ref), _model(LayerInfo))


def build_layer(
    ref: str,
    source: str,
    path: str,
    *,
    rev: str | None = None,
    prefix: str = "/",
    kind: LayerKind = "workspace",
    timeout: float | None = None,
) -> Call[LayerInfo]:
    try:
        body = BuildLayerRequest.model_validate(
            {"ref": ref, "source": source, "path": path, "rev": rev, "prefix": prefix, "kind": kind}
        )
    except ValidationError as exc:
        raise invalid(exc) from None
    return _post("/v1/layers/build", body, timeout)


def tag_layer(source: str, target: str) -> Call[LayerInfo]:
    return _post("/v1/layers/tag", TagLayerRequest(source=source, target=target))


def push_layer(ref: str, timeout: float | None = None) -> Call[LayerInfo]:
    return _post("/v1/layers/push", LayerTransferRequest(ref=ref), timeout)


def pull_layer(ref: str, *, blob: bool = True, timeout: float | None = None) -> Call[LayerInfo]:
    return _post("/v1/layers/pull", LayerTransferRequest(ref=ref, blob=blob), timeout)


def _json(resp: httpx.Response) -> dict[str, Any]:
    doc = resp.json()
    return doc if isinstance(doc, dict) else {}


def layer_cache() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/layer-cache", _json)
