"""Layers on the wire: references, registry entries and layer requests.

A sandbox's root file system is stacked from up to three read-only layers, bottom
first: the base image, a workspace, a toolkit. Each is versioned on its own, so an
update rebuilds one layer instead of every image that contains it. A reference is
``name:version`` (resolved in the layer registry) or a ``sha256:`` digest (exact).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from dsec.api.base import Reply, Strict

LAYER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


LAYER_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


ImageLoading = Literal["lazy", "eager"]


LayerKind = Literal["base", "workspace", "toolkit"]


def check_layer_name(name: str) -> str:
    if not LAYER_NAME_RE.match(name):
        raise ValueError(
            f"invalid layer name {name!r}: lowercase letters, digits and . _ - "
            "(at most 128, starting with a letter or digit)"
        )
    return name


def check_layer_version(version: str) -> str:
    if not LAYER_VERSION_RE.match(version):
        raise ValueError(
            f"invalid layer version {version!r}: letters, digits and . _ - (at most 128)"
        )
    return version


class LayerRef(Strict):
    """``LayerRef("task-repo", "v3")``, ``LayerRef("task-repo:v3")`` or ``LayerRef("sha256:…")``.

    Fields in the model accept the string form too: ``workspace="task-repo:v3"``.
    """

    model_config = ConfigDict(frozen=True)  # a value: compared and hashed by content

    name: str | None = None
    version: str | None = None
    digest: str | None = None

    def __init__(self, name: str | None = None, version: str | None = None, /, **data: Any):
        if name is not None:
            data.update(_split(name) if version is None else {"name": name, "version": version})
        elif version is not None:
            raise ValueError("LayerRef needs a name before a version")
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return _split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> LayerRef:
        if self.digest is not None:
            if self.name is not None or self.version is not None:
                raise ValueError("a layer reference is name:version or a digest, not both")
            if not DIGEST_RE.match(self.digest):
                raise ValueError(
                    f"invalid layer digest {self.digest!r}: expected sha256:<64 hex digits>"
                )
            return self
        if self.name is None:
            raise ValueError("a layer reference needs a name (name:version) or a digest")
        check_layer_name(self.name)
        check_layer_version(self.version or "latest")
        if self.version is None:
            object.__setattr__(self, "version", "latest")
        return self

    def __str__(self) -> str:
        return self.digest if self.digest is not None else f"{self.name}:{self.version}"

    @classmethod
    def parse(cls, text: str) -> LayerRef:
        return cls.model_validate(text)


def _split(text: str) -> dict[str, Any]:
    if text.startswith("sha256:"):
        return {"digest": text}
    name, sep, version = text.partition(":")
    return {"name": name, "version": version} if sep else {"name": name}


class LayerInfo(Reply):
    """A named, versioned layer in a registry (the platform's or a shared store's)."""

    name: str
    version: str
    digest: str = Field(description="SHA-256 of the EROFS blob")
    index_digest: str | None = Field(None, description="SHA-256 of its chunk index (lazy loading)")
    size_bytes: int
    kind: LayerKind = "workspace"
    config: dict[str, object] | None = Field(
        None, description="image config (env, workdir, user) when the layer can be a base"
    )
    source: str | None = Field(None, description="what it was built from")
    created_at: datetime

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_layer_name(v)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_layer_version(v)


class BuildLayerRequest(Strict):
    """Build a layer from a directory, a tar or a git checkout *on the platform's host*."""

    ref: str = Field(description="name:version to register it under")
    source: Literal["dir", "tar", "git"]
    path: str = Field(description="absolute host path of the directory, tar file or git checkout")
    rev: str | None = Field(None, description="git revision (default HEAD)")
    prefix: str = Field("/", description="where the content lands inside the sandbox")
    kind: LayerKind = "workspace"

    @field_validator("path", "prefix")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or "\x00" in v:
            raise ValueError(f"must be an absolute path, got {v!r}")
        return v


class TagLayerRequest(Strict):
    source: str = Field(description="existing layer name:version, image name:tag or digest")
    target: str = Field(description="new name:version")


class LayerTransferRequest(Strict):
    """Push to / pull from the shared layer store configured on the platform."""

    ref: str
    blob: bool = Field(True, description="pull: also fetch the whole blob now (eager)")
