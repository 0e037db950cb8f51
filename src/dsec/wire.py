"""The data path's wire format, shared by the SDK and the edge (no I/O, no server deps).

The data path is one WebSocket per client and edge (``/v1/edge/rpc``), multiplexing any
number of requests, because a command round trip must cost about what the agent costs:
an HTTP request through httpx alone costs ~0.7 ms of client CPU, a WebSocket message
~0.05 ms (measured on our machines).

- Text frames are JSON. A request is ``{"id", "op", "sandbox", "token"?, "args"}``; the
  answer is ``{"id", "result"}`` or ``{"id", "error": {"code", "message", "details"}}``.
  ``{"id": n, "op": "cancel"}`` abandons request ``n`` (a foreground command is killed).
- Binary frames carry output: ``u32 request id, u8 stream (1 stdout, 2 stderr), bytes``,
  always before the request's final answer.
"""

from __future__ import annotations

import signal as _signal
import struct
from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.exec import MAX_OUTPUT_BYTES
from dsec.api.fields import ENV_KEY_RE, USER_RE

STDOUT = 1
STDERR = 2
_DATA = struct.Struct("<IB")

RPC_PATH = "/v1/edge/rpc"
EDGE_PREFIX = "/v1/edge/sandboxes"

SIGNALS: dict[str, int] = {
    "interrupt": int(_signal.SIGINT),
    "terminate": int(_signal.SIGTERM),
    "kill": int(_signal.SIGKILL),
    "hangup": int(_signal.SIGHUP),
    "quit": int(_signal.SIGQUIT),
    "stop": int(_signal.SIGSTOP),
    "continue": int(_signal.SIGCONT),
    "usr1": int(_signal.SIGUSR1),
    "usr2": int(_signal.SIGUSR2),
}


def encode_data(request_id: int, stream: int, data: bytes) -> bytes:
    return _DATA.pack(request_id, stream) + data


def decode_data(frame: bytes) -> tuple[int, int, bytes]:
    if len(frame) < _DATA.size:
        raise ValueError("data frame shorter than its header")
    request_id, stream = _DATA.unpack_from(frame)
    return int(request_id), int(stream), frame[_DATA.size :]


def signal_number(sig: int | str) -> int:
    """``"interrupt"``, ``"SIGTERM"``, ``"term"`` or a number -> signal number."""
    if isinstance(sig, int):
        if not 1 <= sig <= 64:
            raise ValueError(f"invalid signal number {sig}")
        return sig
    name = sig.lower().removeprefix("sig")
    aliases = {"int": "interrupt", "term": "terminate", "hup": "hangup", "cont": "continue"}
    name = aliases.get(name, name)
    if name not in SIGNALS:
        raise ValueError(f"unknown signal {sig!r}; one of {sorted(SIGNALS)} or a number")
    return SIGNALS[name]


class CommandArgs(Strict):
    """One command on the data path (``run`` and ``start``)."""

    command: str | list[str]
    session: str | None = Field(None, description="run in this session (a string command)")
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0, le=86400)
    stdin: str | None = Field(None, description="text fed to stdin, then closed")
    keep_stdin: bool = Field(False, description="leave stdin open for later writes")
    max_output_bytes: int = Field(16 * 1024 * 1024, ge=1, le=MAX_OUTPUT_BYTES)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not v or not v[0] or any("\x00" in a for a in v):
                raise ValueError("command argv must be a non-empty list without NUL bytes")
        elif not v.strip() or "\x00" in v:
            raise ValueError("command must be a non-empty string without NUL bytes")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not ENV_KEY_RE.match(key) or "\x00" in val:
                raise ValueError(f"invalid environment variable {key!r}")
        return v

    @field_validator("workdir")
    @classmethod
    def _wd(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\x00" in v):
            raise ValueError(f"workdir must be an absolute path, got {v!r}")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not USER_RE.match(v):
            raise ValueError(f"user must be a user name or uid[:gid], got {v!r}")
        return v


class SessionArgs(Strict):
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None

    _env = field_validator("env")(CommandArgs._env.__func__)  # type: ignore[attr-defined]
    _wd = field_validator("workdir")(CommandArgs._wd.__func__)  # type: ignore[attr-defined]
    _user = field_validator("user")(CommandArgs._user.__func__)  # type: ignore[attr-defined]


class ExitInfo(Reply):
    """How a command ended (its output came as data frames or is in the result)."""

    exit_code: int = Field(description="exit status; 128+N when killed by signal N")
    timed_out: bool = False
    truncated: bool = Field(False, description="output beyond max_output_bytes was dropped")
    duration: float = 0.0


ProcessState = Literal["running", "exited", "failed"]


class ProcessInfo(Reply):
    """A command started on the data path (foreground or background)."""

    id: str
    sandbox_id: str
    session: str | None = None
    command: str | list[str]
    pid: int = Field(description="process id inside the sandbox")
    state: ProcessState
    background: bool
    started_at: datetime
    exit: ExitInfo | None = None
    error: str | None = Field(None, description="why it failed (agent lost, sandbox stopped)")
    output_bytes: int = Field(0, description="output kept for later readers")


class SessionInfo(Reply):
    id: str
    sandbox_id: str
    user: str
    created_at: datetime
    commands: int = 0
    busy: bool = False


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


class PtyControl(Strict):
    """Text frames of the PTY WebSocket, client to edge."""

    type: Literal["resize"]
    rows: int = Field(ge=1, le=0xFFFF)
    cols: int = Field(ge=1, le=0xFFFF)
