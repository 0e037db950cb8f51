"""SandboxFusion's request and response shapes (its ``sandbox_fusion.models``), and the
one mapping between them and our FnCall models, so that the routes stay plumbing.

Status strings are SandboxFusion's: the run is ``Success`` (every step exited 0),
``Failed`` (a step did not) or ``SandboxError`` (the platform could not run it; the
client raises); a step is ``Finished`` (exited, any code), ``TimeLimitExceeded`` or
``Error`` (stopped by a limit other than time: output cap).
"""

from __future__ import annotations

import base64
import binascii
import os
import signal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec.api.fncall import (
    MAX_CODE_BYTES,
    MAX_FILES,
    MAX_STDIN_BYTES,
    DSecFnCallRunArgs,
    RunCodeRequest,
    RunCodeResult,
    StepResult,
)
from dsec.errors import InvalidArgument
from dsec.fncall.toolchain import TOOLCHAIN_REF

RunStatus = Literal["Success", "Failed", "SandboxError"]
StepStatus = Literal["Finished", "Error", "TimeLimitExceeded"]

#: SandboxFusion language -> ours. Languages missing here are answered ``SandboxError``
#: naming the supported ones (the client raises with that message).
LANGUAGES: dict[str, str] = {"python": "python", "bash": "bash", "cpp": "cpp", "nodejs": "node"}

IMAGE_ENV = "DSEC_SANDBOXFUSION_IMAGE"  # the image every run uses
MEMORY_ENV = "DSEC_SANDBOXFUSION_MEMORY_MB"  # when a request names no memory_limit_MB
MAX_TIMEOUT_S = 600.0


class SFRunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest``; unknown fields are ignored as its server does."""

    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = Field(10, gt=0)
    run_timeout: float = Field(10, gt=0)
    code: str = Field(max_length=MAX_CODE_BYTES)
    stdin: str | None = Field(None, max_length=MAX_STDIN_BYTES)
    language: str = Field(max_length=64)
    files: dict[str, str | None] = Field(default_factory=dict, max_length=MAX_FILES)
    fetch_files: list[str] = Field(default_factory=list, max_length=MAX_FILES)
    memory_limit_MB: int | None = Field(None, ge=16, le=64 * 1024)  # verl sends it


class SFCommandRunResult(BaseModel):
    status: StepStatus
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class SFRunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: SFCommandRunResult | None = None
    run_result: SFCommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def _text_files(files: dict[str, str | None]) -> dict[str, str]:
    """SandboxFusion sends base64; our FnCall files are UTF-8 text (path -> text)."""
    out: dict[str, str] = {}
    for path, data in files.items():
        if data is None:
            continue
        try:
            out[path] = base64.b64decode(data, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise InvalidArgument(
                f"file {path!r}: only base64 of UTF-8 text is supported here ({exc})"
            ) from exc
    return out


def to_request(req: SFRunCodeRequest) -> RunCodeRequest:
    """Our FnCall request for ``req``; InvalidArgument for what has no mapping."""
    language = LANGUAGES.get(req.language)
    if language is None:
        raise InvalidArgument(
            f"language {req.language!r} is not supported here; supported: "
            + ", ".join(sorted(LANGUAGES))
        )
    if req.fetch_files:
        raise InvalidArgument("fetch_files is not supported: FnCall runs keep no files")
    args = DSecFnCallRunArgs(
        image=os.environ.get(IMAGE_ENV, TOOLCHAIN_REF),
        language=language,
        memory_limit_mb=req.memory_limit_MB or int(os.environ.get(MEMORY_ENV, "1024")),
        timeout_s=min(req.run_timeout, MAX_TIMEOUT_S),
        compile_timeout_s=min(req.compile_timeout, MAX_TIMEOUT_S),
    )
    return RunCodeRequest(
        args=args, code=req.code, stdin=req.stdin or "", files=_text_files(req.files)
    )


def _return_code(exit_code: int | None, sig: int | None) -> int | None:
    """Python's subprocess convention, which SandboxFusion reports: -N for signal N."""
    return -sig if sig else exit_code


def _step(s: StepResult, status: StepStatus = "Finished") -> SFCommandRunResult:
    return SFCommandRunResult(
        status=status,
        execution_time=s.wall_time_s,
        cpu_time=s.cpu_time_s,
        return_code=_return_code(s.exit_code, s.signal),
        stdout=s.stdout,
        stderr=s.stderr,
    )


def from_result(r: RunCodeResult, *, compiled_language: bool) -> SFRunCodeResponse:
    """SandboxFusion's answer for our result (the table in the module docstring)."""
    compile_result = _step(r.compile) if r.compile is not None else None
    if r.status == "compile_error":
        return SFRunCodeResponse(
            status="Failed", message="", compile_result=compile_result, run_result=None
        )
    if r.status == "timeout" and compiled_language and r.compile is None:
        # The compile itself ran out of time: nothing ran.
        over = SFCommandRunResult(status="TimeLimitExceeded", execution_time=r.wall_time_s)
        return SFRunCodeResponse(status="Failed", message="", compile_result=over)
    run_status: StepStatus = "Finished"
    if r.status == "timeout":
        run_status = "TimeLimitExceeded"
    elif r.status == "output_limit":
        run_status = "Error"
    sig = r.signal
    if r.status == "memory_limit" and not sig:
        sig = int(signal.SIGKILL)  # the OOM killer's signal, as SandboxFusion sees it
    run = SFCommandRunResult(
        status=run_status,
        execution_time=r.wall_time_s,
        cpu_time=r.cpu_time_s,
        return_code=None if run_status == "TimeLimitExceeded" else _return_code(r.exit_code, sig),
        stdout=r.stdout,
        stderr=r.stderr,
    )
    ok = r.status == "ok"
    return SFRunCodeResponse(
        status="Success" if ok else "Failed",
        message="" if ok else r.status,
        compile_result=compile_result,
        run_result=run,
    )
