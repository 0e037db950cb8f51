"""The FnCall backend on the wire: stateless code runs from warm pools.

Shared by the SDK, the apiserver and the backend. ``DSecFnCallRunArgs`` is not a
sandbox run spec (nothing creates a long-lived FnCall sandbox): it is the limits of one
call, and calls with equal args share a warm pool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.fields import check_network_rules

# Bounds on what one request may carry (typed 422 beyond them).
MAX_CODE_BYTES = 1 << 20


MAX_STDIN_BYTES = 16 << 20


MAX_FILES = 64


MAX_FILE_BYTES = 8 << 20


MAX_TESTS = 1000


MAX_OUTPUT_BYTES = 64 << 20


#: The FnCall WebSocket (API key): ``dsec.api.datapath``'s framing (JSON text frames
#: ``{"id", "op", "args"}`` answered by ``{"id", "result"}`` or ``{"id", "error"}``, ``{"id", "op":
#: "cancel"}``) with the ops below, whose args and result are those of the HTTP routes.
#: Why: a warm call costs ~1-3 ms on the edge, an HTTP request through FastAPI and httpx
#: ~3 ms more; a message on an open WebSocket ~0.3 ms (bench/bench_fncall.py).
FNCALL_RPC_PATH = "/v1/fncall/rpc"


OP_RUN, OP_JUDGE, OP_CALL = "fncall.run", "fncall.judge", "fncall.call"


RunStatus = Literal[
    "ok", "runtime_error", "timeout", "memory_limit", "compile_error", "output_limit"
]


Verdict = Literal["AC", "WA", "TLE", "MLE", "RE", "CE", "OLE"]


Comparator = Literal["exact", "whitespace", "float"]


class DSecFnCallRunArgs(Strict):
    """Limits and image of a stateless call. Calls with equal args share a warm pool.
    Interpreted languages (python, bash, sh) get pools of their own whose sandboxes
    hold the interpreter already started, waiting for the program; compiled languages
    share one pool per image and limits."""

    image: str = Field("debian-python:bookworm", description="image ref name[:tag]")
    language: str = Field("python", description="python, bash, sh, c, cpp, node")
    memory_limit_mb: int = Field(256, ge=16, le=64 * 1024, description="hard memory limit")
    cpu_cores_limit: float = Field(1.0, gt=0, le=64, description="CPU quota in cores")
    pids_limit: int = Field(256, ge=8, le=32768, description="max processes and threads")
    timeout_s: float = Field(10.0, gt=0, le=600, description="wall-time limit of the run")
    cpu_time_s: float | None = Field(
        None, gt=0, le=600, description="CPU-time limit of the run; None = timeout_s"
    )
    compile_timeout_s: float = Field(30.0, gt=0, le=600, description="wall limit of a compile")
    output_limit_bytes: int = Field(
        1 << 20, ge=1024, le=MAX_OUTPUT_BYTES, description="stdout+stderr cap"
    )
    network_rules: dict[str, bool] = Field(
        default_factory=dict, description="egress rules; FnCall supports none yet ({})"
    )
    loopback: bool = Field(
        False,
        description="a network namespace of its own with loopback up (for programs that "
        "talk to themselves over 127.0.0.1); costs more per call than the default",
    )
    env: dict[str, str] = Field(default_factory=dict)
    job_id: str | None = Field(None, max_length=128)
    trajectory_id: str | None = Field(None, max_length=128)

    @field_validator("network_rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)


class RunCodeRequest(Strict):
    args: DSecFnCallRunArgs = Field(default_factory=lambda: DSecFnCallRunArgs())
    code: str = Field(description="program source")
    stdin: str = ""
    files: dict[str, str] = Field(
        default_factory=dict, description="extra files: path (relative to /work) -> text"
    )
    argv: list[str] = Field(default_factory=list, max_length=256)


class StepResult(Reply):
    """One executed step (the compile of a compiled language)."""

    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0


class RunCodeResult(Reply):
    call_id: str
    status: RunStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    peak_memory_bytes: int = 0
    compile: StepResult | None = None
    warm: bool = Field(True, description="served from a ready sandbox (no wait)")
    latency_s: float = Field(0.0, description="time on the edge, sandbox acquire included")


class JudgeTest(Strict):
    stdin: str = ""
    expected: str = ""


class JudgeRequest(Strict):
    args: DSecFnCallRunArgs = Field(default_factory=lambda: DSecFnCallRunArgs())
    code: str
    tests: list[JudgeTest] = Field(min_length=1, max_length=MAX_TESTS)
    comparator: Comparator = "whitespace"
    float_tolerance: float = Field(1e-6, ge=0)
    stop_on_failure: bool = False
    files: dict[str, str] = Field(default_factory=dict)


class TestVerdict(Reply):
    verdict: Verdict
    status: RunStatus
    exit_code: int | None = None
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    peak_memory_bytes: int = 0
    stdout: str = Field("", description="first 4 KiB")
    stderr: str = Field("", description="first 4 KiB")


class JudgeResult(Reply):
    call_id: str
    verdict: Verdict = Field(description="AC if every test passed, else the first failure")
    passed: int
    total: int
    compile: StepResult | None = None
    tests: list[TestVerdict] = Field(default_factory=list)
    wall_time_s: float = 0.0


class WarmPoolRequest(Strict):
    args: DSecFnCallRunArgs = Field(default_factory=lambda: DSecFnCallRunArgs())
    size: int = Field(8, ge=0, le=4096)
    wait: bool = True
    timeout_s: float = Field(30.0, gt=0, le=600)


class PoolInfo(Reply):
    key: str
    image: str
    memory_limit_mb: int
    cpu_cores_limit: float
    ready: int
    starting: int
    in_use: int
    target: int
    created: int
    destroyed: int
    misses: int
    warm_s: float | None = Field(None, description="time the last warm request took")


class LanguageInfo(Reply):
    name: str
    aliases: list[str]
    compiled: bool
    needs: str


class CallRequest(Strict):
    """``client.call(fn, *args)``: (fn, args, kwargs) pickled with cloudpickle."""

    args: DSecFnCallRunArgs = Field(default_factory=lambda: DSecFnCallRunArgs())
    payload_b64: str = Field(max_length=12 << 20)
    python: str = Field(pattern=r"^\d+\.\d+$", description="the caller's major.minor")


class CallResult(RunCodeResult):
    result_b64: str | None = Field(
        None, description="cloudpickle of (ok, value or exception, traceback text)"
    )
