"""/v1/images: list, inspect, remove, build the built-in images, import archives.

An image reference may contain '/', so the single-image routes use a path converter;
``build`` and ``import`` are declared first so that they win over ``{ref:path}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from dsec.api.images import (
    BuildImageRequest,
    ComposeImageRequest,
    ImageInfo,
    PullImageRequest,
    PullResult,
    RegisterVMRequest,
    VMBlobInfo,
)
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.limits import ApiLimits, set_body_limit
from dsec.apiserver.params import check_image_ref
from dsec.apiserver.responses import images_response, model_response
from dsec.errors import InvalidArgument
from dsec.images.oci.auth import Credentials
from dsec.images.service import ArchiveFormat, ImageService


async def _nonempty(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        if chunk:
            yield chunk


def image_router(images: ImageService, auth: Authenticator, limits: ApiLimits) -> APIRouter:
    router = APIRouter(
        prefix="/v1/images",
        tags=["images"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.get("", response_model=list[ImageInfo], summary="List images")
    async def list_images() -> Response:
        return images_response(await images.list())

    @router.post("/build", response_model=ImageInfo, summary="Build a built-in image")
    async def build_image(body: BuildImageRequest) -> Response:
        """busybox:latest or debian-python:bookworm; cached unless `rebuild` is set."""
        ref = check_image_ref(body.name) if body.name is not None else None
        info = await images.build(body.recipe, ref=ref, rebuild=body.rebuild)
        return model_response(info)

    @router.post("/pull", response_model=PullResult, summary="Pull an image from a registry")
    async def pull_image(body: PullImageRequest) -> Response:
        """OCI distribution protocol; each registry layer becomes one EROFS layer, shared
        by every image with the same layer. Stored under the reference as given."""
        ref = check_image_ref(body.ref)
        if (body.username is None) != (body.password is None):
            raise InvalidArgument("give both a username and a password, or neither")
        creds = (
            Credentials(body.username, body.password)
            if body.username is not None and body.password is not None
            else None
        )
        result = await images.pull(ref, credentials=creds, streaming=body.streaming)
        return model_response(result)

    @router.put(
        "/import",
        response_model=ImageInfo,
        summary="Import an image archive",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {}}},
                "description": "a rootfs tar, a `docker save` tar or an OCI layout tar",
            }
        },
    )
    async def import_image(
        request: Request,
        ref: Annotated[str, Query(description="name:tag to store the image under")],
        fmt: Annotated[ArchiveFormat, Query(alias="format")] = "auto",
    ) -> Response:
        """Stream the archive in the request body into the layer store."""
        check_image_ref(ref)
        set_body_limit(request, limits.max_import_bytes, "image archive")
        info = await images.import_archive(ref, _nonempty(request.stream()), fmt=fmt)
        return model_response(info)

    @router.put(
        "/vm-blobs",
        response_model=VMBlobInfo,
        summary="Upload a file of a VM image",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {}}},
                "description": "a disk (raw or qcow2), a kernel or an initrd, as it is",
            }
        },
    )
    async def add_vm_blob(request: Request) -> Response:
        """Stored content-addressed in the layer store; tag it with `POST /vm`."""
        set_body_limit(request, limits.max_import_bytes, "VM image file")
        digest, size = await images.add_vm_blob(_nonempty(request.stream()))
        return model_response(VMBlobInfo(digest=digest, size_bytes=size))

    @router.post("/vm", response_model=ImageInfo, summary="Tag uploaded files as a VM image")
    async def register_vm(body: RegisterVMRequest) -> Response:
        """The disk is inspected first: raw, or qcow2 naming no backing or data file."""
        ref = check_image_ref(body.ref)
        info = await images.register_vm(
            ref, body.disk, kernel=body.kernel, initrd=body.initrd, cmdline=body.cmdline
        )
        return model_response(info)

    @router.post("/compose", response_model=ImageInfo, summary="Tag layers as an image")
    async def compose_image(body: ComposeImageRequest) -> Response:
        """Layers already on the platform (by digest, bottom first) plus a config:
        what a Dockerfile build registers after each step."""
        ref = check_image_ref(body.ref)
        info = await images.register_layers(ref, body.layers, body.config.model_dump())
        return model_response(info)

    @router.get("/{ref:path}", response_model=ImageInfo, summary="Inspect an image")
    async def get_image(ref: str) -> Response:
        return model_response(await images.resolve(check_image_ref(ref)))

    @router.delete("/{ref:path}", response_model=ImageInfo, summary="Remove an image tag")
    async def remove_image(ref: str) -> Response:
        return model_response(await images.remove(check_image_ref(ref)))

    return router
