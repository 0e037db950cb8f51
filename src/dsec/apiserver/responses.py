"""Serialise models straight to bytes, skipping FastAPI's response re-validation.

Routes declare ``response_model`` for the OpenAPI schema but return these Responses, so
a result is dumped once by pydantic's Rust serializer and never validated twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, TypeAdapter
from starlette.responses import Response

from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxInfo

_JSON = "application/json"
_sandbox_list: TypeAdapter[list[SandboxInfo]] = TypeAdapter(list[SandboxInfo])
_image_list: TypeAdapter[list[ImageInfo]] = TypeAdapter(list[ImageInfo])


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type=_JSON)


def sandboxes_response(items: Sequence[SandboxInfo]) -> Response:
    return Response(_sandbox_list.dump_json(list(items)), media_type=_JSON)


def images_response(items: Sequence[ImageInfo]) -> Response:
    return Response(_image_list.dump_json(list(items)), media_type=_JSON)
