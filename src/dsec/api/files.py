"""File operations on the wire: listings and the requests that change a sandbox's files."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from dsec.api.base import Reply, Strict

FileType = Literal["file", "directory", "symlink", "fifo", "socket", "char", "block", "unknown"]


class FileInfo(Reply):
    path: str = Field(description="absolute, or relative to the listed directory")
    type: FileType
    mode: int = Field(description="permission bits, e.g. 0o644 = 420")
    size: int
    mtime: datetime
    uid: int
    gid: int
    target: str | None = Field(None, description="where a symlink points (not followed)")


class FileList(Reply):
    entries: list[FileInfo]
    truncated: bool = Field(False, description="more entries than the limit")


class MkdirRequest(Strict):
    path: str
    parents: bool = True
    mode: int = Field(0o755, ge=0, le=0o7777)


class RemoveRequest(Strict):
    path: str
    recursive: bool = False


class MoveRequest(Strict):
    src: str
    dst: str


class ChmodRequest(Strict):
    path: str
    mode: int = Field(ge=0, le=0o7777)
