"""Protected paths on the wire: grader or answer files only a verifier sees.

A ``ProtectedMount`` names a path and where its content comes from: a layer of the
layer registry (content-addressed, built once, shared by every sandbox on a host: the
right source for a grader suite) or inline files in the request (small per-rollout
answers). Never a host path: the platform is multi-tenant, and a caller who could name
a host directory could read any file the edge can. The content is never in the agent's
sandbox; only ``verify`` runs see it (see dsec.security.protected).
"""

from __future__ import annotations

import itertools
import posixpath

from pydantic import ConfigDict, Field, field_validator, model_validator

from dsec.api.base import Strict
from dsec.api.layers import LayerRef

MAX_PROTECTED_MOUNTS = 8


MAX_INLINE_FILES = 256


MAX_INLINE_BYTES = 1024 * 1024


# Paths the platform itself mounts or the kernel owns: a protected mount there would
# shadow them in the verifier, or be meaningless.
RESERVED_PREFIXES = ("/proc", "/sys", "/dev", "/.dsec")


def _check_path(value: str) -> str:
    if not value.startswith("/") or "\x00" in value or len(value) > 1024:
        raise ValueError(f"protected path must be an absolute path without NUL, got {value!r}")
    norm = posixpath.normpath(value)
    if norm != value.rstrip("/") or ".." in value.split("/"):
        raise ValueError(f"protected path must be normalised (no '..', '//', '.'), got {value!r}")
    if norm == "/":
        raise ValueError("the root directory cannot be a protected path")
    for prefix in RESERVED_PREFIXES:
        if norm == prefix or norm.startswith(prefix + "/"):
            raise ValueError(f"protected path {value!r} is under reserved {prefix}")
    return norm


def _check_rel(name: str) -> str:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\x00" in name
        or any(p in ("", ".", "..") for p in parts)
        or len(name) > 1024
    ):
        raise ValueError(f"inline file name must be a relative path without '..', got {name!r}")
    return name


class ProtectedMount(Strict):
    """``path`` shows ``layer``'s root directory or the inline ``files`` (exactly one)
    read-only, in verifier runs only. In the agent's sandbox the path is an empty
    read-only look-alike whose every open is reported as a ``protected_path`` event."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="absolute path, e.g. /grader")
    layer: LayerRef | None = Field(
        None, description="layer name:version or digest; its root directory appears at path"
    )
    files: dict[str, str] = Field(
        default_factory=dict, description="inline text files: relative name -> content"
    )

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_path(v)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_INLINE_FILES:
            raise ValueError(f"at most {MAX_INLINE_FILES} inline files per protected path")
        total = 0
        names = set(v)
        for name, content in v.items():
            _check_rel(name)
            total += len(content.encode())
            parent = name.rpartition("/")[0]
            while parent:
                if parent in names:
                    raise ValueError(f"inline file {parent!r} is also a directory of {name!r}")
                parent = parent.rpartition("/")[0]
        if total > MAX_INLINE_BYTES:
            raise ValueError(
                f"inline files are {total} bytes, more than {MAX_INLINE_BYTES}: "
                "build a layer (dsec layer build) for bigger content"
            )
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ProtectedMount:
        if (self.layer is None) == (not self.files):
            raise ValueError(f"protected path {self.path}: give exactly one of layer or files")
        return self


def check_protected(mounts: list[ProtectedMount]) -> list[ProtectedMount]:
    """At most a few, and no path inside another (one would hide the other)."""
    if len(mounts) > MAX_PROTECTED_MOUNTS:
        raise ValueError(f"at most {MAX_PROTECTED_MOUNTS} protected paths")
    paths = sorted(m.path for m in mounts)
    for a, b in itertools.pairwise(paths):
        if a == b or b.startswith(a + "/"):
            raise ValueError(f"protected paths {a!r} and {b!r} overlap")
    return mounts
