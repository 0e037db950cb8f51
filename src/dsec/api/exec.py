"""Commands on the wire: one-shot exec requests and results, data-path commands,
processes and shell sessions, signals by name."""

from __future__ import annotations

import signal as _signal
from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator

from dsec.api.base import Reply, Strict
from dsec.api.fields import TRAJECTORY_NAME_RE, USER_RE, check_abs_path, check_env

MAX_OUTPUT_BYTES = 64 * 1024 * 1024


class TrajectoryRef(Strict):
    """Which step of which rollout a state-changing request is (see dsec.rl.trajectory):
    logged before it is answered, answered from the log when sent again."""

    job_id: str = Field(pattern=TRAJECTORY_NAME_RE.pattern)
    rollout_id: str = Field(pattern=TRAJECTORY_NAME_RE.pattern)
    step: int = Field(ge=0, le=1 << 40)


class ExecRequest(Strict):
    """One command. A string runs through ``/bin/sh -c``; a list is an argv."""

    command: str | list[str]
    trajectory: TrajectoryRef | None = Field(
        None, description="log and replay this command as a step of a trajectory"
    )
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0, le=86400, description="seconds; kills the command")
    stdin: str | None = Field(None, description="text fed to the command's stdin")
    max_output_bytes: int = Field(16 * 1024 * 1024, ge=1, le=MAX_OUTPUT_BYTES)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not v or not v[0]:
                raise ValueError("command argv must be a non-empty list")
            if any("\x00" in a for a in v):
                raise ValueError("command arguments must not contain NUL bytes")
        elif not v.strip() or "\x00" in v:
            raise ValueError("command must be a non-empty string without NUL bytes")
        return v

    @field_validator("workdir")
    @classmethod
    def _wd(cls, v: str | None) -> str | None:
        return None if v is None else check_abs_path(v, "workdir")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not USER_RE.match(v):
            raise ValueError(f"user must be a user name or uid[:gid], got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class ExecResult(Reply):
    exit_code: int = Field(description="exit status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    duration: float = Field(description="seconds from start to exit inside the sandbox")
    timed_out: bool = False
    truncated: bool = Field(False, description="output beyond max_output_bytes was dropped")


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
        return check_env(v)

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
