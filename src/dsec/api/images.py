"""Images on the wire: what an image is and how to ask for one to be built."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.fields import check_env
from dsec.api.layers import DIGEST_RE


class ImageInfo(Reply):
    name: str
    tag: str
    digest: str = Field(description="digest of the image manifest")
    layers: list[str] = Field(description="layer digests, bottom first")
    size_bytes: int
    created_at: datetime
    config: dict[str, object] = Field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


class BuildImageRequest(Strict):
    recipe: Literal["busybox", "debian-python"]
    name: str | None = None
    rebuild: bool = False


class ImageConfigSpec(Strict):
    """What a sandbox started from an image inherits (a Dockerfile's ENV, WORKDIR,
    USER, CMD, ENTRYPOINT; LABEL, EXPOSE, SHELL, STOPSIGNAL and HEALTHCHECK are recorded)."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    exposed_ports: list[str] = Field(default_factory=list)
    # Recorded for whoever runs the image (Docker's Shell, StopSignal, Healthcheck): a
    # Dockerfile build inherits SHELL from its base; the platform runs no health checks.
    shell: list[str] | None = None
    stop_signal: str | None = Field(None, max_length=32)
    healthcheck: dict[str, Any] | None = None

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if not v.startswith("/") or "\x00" in v or len(v) > 4096:
            raise ValueError(f"workdir must be an absolute path, got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class ComposeImageRequest(Strict):
    """Tag layers already on the platform, bottom first, as an image with a config
    (``POST /v1/images/compose``): how a Dockerfile build (dsec.sdk.dockerfile) stacks
    the layer of each step on its base."""

    ref: str = Field(description="name:tag")
    layers: list[str] = Field(min_length=1, max_length=128, description="layer digests")
    config: ImageConfigSpec = Field(default_factory=ImageConfigSpec)

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[str]) -> list[str]:
        for digest in v:
            if not DIGEST_RE.match(digest):
                raise ValueError(f"invalid layer digest {digest!r}: expected sha256:<64 hex>")
        return v


class VMBlobInfo(Reply):
    """A file of a VM image in the layer store (``PUT /v1/images/vm-blobs``)."""

    digest: str
    size_bytes: int


class RegisterVMRequest(Strict):
    """Tag uploaded blobs as a VM image (``POST /v1/images/vm``): a disk (raw or
    qcow2, without backing or data files), and for a direct kernel boot a kernel,
    an optional initrd and the kernel command line."""

    ref: str = Field(description="name:tag")
    disk: str = Field(description="digest of the disk blob")
    kernel: str | None = Field(None, description="digest of a kernel (direct boot)")
    initrd: str | None = Field(None, description="digest of an initrd")
    cmdline: str | None = Field(None, max_length=2048, description="kernel command line")


class SnapshotRequest(Strict):
    """Save a running full VM as a VM image (``POST {EDGE_PREFIX}/{id}/snapshot``):
    ``ref`` must not name an existing image (409 ``already_exists``)."""

    ref: str = Field(description="name:tag of the new VM image")


class PullImageRequest(Strict):
    """Pull an image from an OCI registry (``POST /v1/images/pull``). Credentials given
    here are used for this pull only and never stored; without them the platform's
    registry credentials file (Docker ``config.json`` format) is used, then anonymous."""

    ref: str = Field(description="[registry[:port]/]path[:tag][@sha256:<hex>]")
    username: str | None = Field(None, max_length=512)
    password: str | None = Field(None, max_length=8192)
    streaming: bool = Field(True, description="convert each layer while it downloads")


class PullLayerReport(Reply):
    blob: str = Field(description="digest of the registry's (compressed) layer blob")
    diff_id: str = Field(description="digest of the uncompressed layer tar")
    digest: str = Field(description="our EROFS layer's digest")
    reused: bool = Field(description="already converted here or in the layer store")
    fetched_bytes: int
    uncompressed_bytes: int
    erofs_bytes: int
    convert_seconds: float
    left_out: list[str] = Field(
        default_factory=list,
        description="entries not converted, with why (device nodes: never part of a layer)",
    )
    lower_links: int = Field(0, description="hard links to a lower layer's file, copied up")


class PullResult(Reply):
    """What a pull did: the image, and per layer whether it was converted or reused."""

    image: ImageInfo
    source: str = Field(description="the registry reference the image came from")
    manifest_digest: str
    layers: list[PullLayerReport]
    bytes_fetched: int
    seconds: float
