"""Images on the wire: what an image is and how to ask for one to be built."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from dsec.api.base import Reply, Strict


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
