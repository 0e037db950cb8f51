"""Verify steps on the wire: what a grader sees, and the verdict it gives.

A verify step is where a reward is decided, so its wire shapes say exactly what is
trusted: the grader ``command`` (the caller's), the platform's pristine layers and the
protected paths; and what is not: the agent's files, which reach the verifier only as
read-only *data* under the ``graded`` paths (a snapshot taken while the agent is frozen,
links that would leave a graded tree refused). ``mode`` says whether the agent survives
the step (``isolated``) or is stopped first so nothing the verifier does can flow back
to it (``fresh``, the default). Which paths a step grades by default is decided on the
edge (dsec.security.graded_paths); the mechanics are in dsec.backends.container.verifier.
"""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dsec.api.base import Reply
from dsec.api.exec import ExecRequest, ExecResult

VerifyMode = Literal["fresh", "isolated"]


MAX_GRADED_PATHS = 16


# Where an agent keeps its work when the spec's workdir is "/": graded by default, each
# only if it exists in the agent's tree. Never a system directory (see SYSTEM_PREFIXES).
DEFAULT_GRADED = ("/work", "/workspace", "/testbed", "/app", "/srv", "/root", "/home")


# A graded path replaces the pristine content at that path in the verifier, so grading
# one of these would hand the grader the agent's interpreter, loader or shell.
SYSTEM_PREFIXES = (
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr",
    "/etc",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
    "/run",
    "/.dsec",
)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def check_graded_path(value: str) -> str:
    """A normalised absolute path outside the system directories."""
    if not value.startswith("/") or "\x00" in value or len(value) > 1024:
        raise ValueError(f"graded path must be an absolute path without NUL, got {value!r}")
    norm = posixpath.normpath(value)
    if norm in ("/", "//"):
        raise ValueError("the root directory cannot be graded: name the agent's work paths")
    if norm != value.rstrip("/") or ".." in value.split("/") or norm.startswith("//"):
        raise ValueError(f"graded path must be normalised (no '..', '//', '.'), got {value!r}")
    if any(c in norm for c in ",:\\") or any(not c.isprintable() or c.isspace() for c in norm):
        raise ValueError(
            f"graded path {value!r} has a character a mount option cannot carry "
            "(',', ':', '\\', spaces or control characters)"
        )
    for prefix in SYSTEM_PREFIXES:
        if _under(norm, prefix):
            raise ValueError(
                f"graded path {value!r} is under {prefix}: the verifier's system files "
                "always come from the pristine image, never from the agent"
            )
    return norm


class VerifyRequest(ExecRequest):
    """A grader command and the agent paths it grades.

    The command runs as ``user`` (default root) with a fixed environment (see the
    README), in ``workdir`` (default ``/``: interpreters put their working directory on
    the module path, so starting inside a graded tree would import the agent's files).
    """

    graded: list[str] | None = Field(
        None,
        description="agent paths the grader sees (read-only snapshots); None: the spec's "
        "workdir, or the usual work directories when that is /",
    )
    mode: VerifyMode = Field(
        "fresh",
        description="fresh: stop the agent first, nothing flows back (default); isolated: "
        "freeze it and let it go on after the step",
    )

    @field_validator("graded")
    @classmethod
    def _graded(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("graded must name at least one path (or be left out)")
        if len(v) > MAX_GRADED_PATHS:
            raise ValueError(f"at most {MAX_GRADED_PATHS} graded paths")
        return [check_graded_path(p) for p in v]

    @model_validator(mode="after")
    def _no_trajectory(self) -> VerifyRequest:
        if self.trajectory is not None:
            raise ValueError("a verify step is not a trajectory step: leave trajectory out")
        return self


class GradedRefusal(Reply):
    """Something in a graded tree the verifier does not show, and why."""

    path: str = Field(description="path in the agent's sandbox (untrusted text)")
    reason: str


class VerifyResult(ExecResult):
    """The grader's outcome. ``passed`` is decided by the platform from the grader's
    exit status alone (never from its output, which may carry the agent's text)."""

    passed: bool = Field(description="the grader exited 0 within its timeout")
    mode: VerifyMode = "fresh"
    graded: list[str] = Field(default_factory=list, description="paths snapshotted")
    refused: list[GradedRefusal] = Field(
        default_factory=list, description="graded entries left out (links leaving the tree, ...)"
    )
    results: dict[str, str] = Field(
        default_factory=dict,
        description="files the grader wrote to $DSEC_RESULT_DIR (only it can write there)",
    )
    error: str | None = Field(None, description="why the grader did not run, if it did not")
