"""Commands and files in a full VM through its guest agent (qga.GuestAgent).

Why these shapes: qemu-ga 7.2 has ``guest-exec`` (argv, environment, stdin, captured
output, no working directory, no user, no kill) and ``guest-file-*`` (open, read,
write, close by handle, no mode). What the platform's ``exec`` and file calls need on
top is done with a POSIX shell in the guest where it must be (a working directory,
a write that lands atomically with its mode, killing a command past its timeout), so
these need a guest with ``/bin/sh``; the agent itself is the guest's own, unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from dataclasses import dataclass
from typing import Any

from dsec.backends.fullvm.qga import GuestAgent, GuestAgentError, b64, field
from dsec.errors import InvalidArgument, LimitExceeded

POLL_FIRST = 0.02  # seconds between guest-exec-status polls, doubling up to POLL_MAX
POLL_MAX = 0.25
CHUNK = 1 << 20  # bytes per guest-file-read / guest-file-write
GUEST_OUTPUT_MAX = 16 << 20  # qemu-ga's own cap per output stream of a command


@dataclass(frozen=True)
class Finished:
    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    duration: float


def command_argv(command: str | list[str], workdir: str | None) -> list[str]:
    """The argv to hand guest-exec: a string runs through ``/bin/sh -c``; a working
    directory is entered by a shell first (guest-exec has none)."""
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    if workdir is None or workdir == "/":
        return argv if workdir is None else ["/bin/sh", "-c", 'cd / && exec "$@"', "sh", *argv]
    return ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", workdir, *argv]


async def run(
    agent: GuestAgent,
    argv: list[str],
    *,
    env: dict[str, str],
    stdin: bytes | None,
    timeout: float | None,
    max_output: int,
) -> Finished:
    """Run ``argv`` to its end (or ``timeout``: then it is killed, best effort, with
    the guest's ``kill``); output cut to ``max_output`` bytes per stream."""
    args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
    if env:
        args["env"] = [f"{k}={v}" for k, v in env.items()]
    if stdin:
        args["input-data"] = base64.b64encode(stdin).decode()
    t0 = time.monotonic()
    started = await agent.call("guest-exec", args)
    pid = field(started, "pid", int, "guest-exec")
    deadline = None if timeout is None else t0 + timeout
    delay = POLL_FIRST
    while True:
        status = await agent.call("guest-exec-status", {"pid": pid}, timeout=30)
        if field(status, "exited", bool, "guest-exec-status"):
            break
        if deadline is not None and time.monotonic() >= deadline:
            await _kill(agent, pid)
            return Finished(124, b"", b"", False, True, time.monotonic() - t0)
        await asyncio.sleep(delay)
        delay = min(POLL_MAX, delay * 2)
    out = b64(status.get("out-data"), "command output", GUEST_OUTPUT_MAX)
    err = b64(status.get("err-data"), "command output", GUEST_OUTPUT_MAX)
    truncated = status.get("out-truncated") is True or status.get("err-truncated") is True
    if len(out) > max_output or len(err) > max_output:
        out, err, truncated = out[:max_output], err[:max_output], True
    code = status.get("exitcode")
    sig = status.get("signal")
    if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 128:
        exit_code = 128 + sig
    elif isinstance(code, int) and not isinstance(code, bool) and 0 <= code < 256:
        exit_code = code
    else:
        raise GuestAgentError(
            "the guest agent's answer to guest-exec-status has no valid exit status"
        )
    return Finished(exit_code, out, err, truncated, False, time.monotonic() - t0)


async def _kill(agent: GuestAgent, pid: int) -> None:
    try:
        await agent.call("guest-exec", {"path": "/bin/kill", "arg": ["-KILL", str(pid)]}, timeout=5)
    except GuestAgentError:
        raise
    except Exception:  # the command may have ended meanwhile: nothing to kill
        return


async def read_file(agent: GuestAgent, path: str, *, max_bytes: int) -> bytes:
    """The file's bytes; LimitExceeded past ``max_bytes``."""
    handle = field(
        {"h": await agent.call("guest-file-open", {"path": path, "mode": "r"})},
        "h",
        int,
        "guest-file-open",
    )
    data = bytearray()
    try:
        while True:
            ask = min(CHUNK, max_bytes - len(data) + 1)
            got = await agent.call("guest-file-read", {"handle": handle, "count": ask})
            chunk = b64(field(got, "buf-b64", str, "guest-file-read"), "file data", ask)
            data += chunk
            if len(data) > max_bytes:
                raise LimitExceeded(f"{path} is larger than {max_bytes} bytes", max_bytes=max_bytes)
            if got.get("eof") is True or not chunk:
                return bytes(data)
    finally:
        await _close(agent, handle)


async def write_file(agent: GuestAgent, path: str, data: bytes, *, mode: int) -> None:
    """Write to a temporary name next to ``path``, set ``mode``, rename into place:
    readers in the guest see the old file or the new one."""
    if not path.startswith("/") or "\0" in path:
        raise InvalidArgument(f"path must be absolute, got {path!r}")
    tmp = f"{path}.dsec-{secrets.token_hex(4)}"
    handle = field(
        {"h": await agent.call("guest-file-open", {"path": tmp, "mode": "w"})},
        "h",
        int,
        "guest-file-open",
    )
    try:
        for off in range(0, len(data), CHUNK):
            piece = data[off : off + CHUNK]
            wrote = await agent.call(
                "guest-file-write", {"handle": handle, "buf-b64": base64.b64encode(piece).decode()}
            )
            if field(wrote, "count", int, "guest-file-write") != len(piece):
                raise GuestAgentError(f"short write to {tmp} in the guest")
    finally:
        await _close(agent, handle)
    done = await run(
        agent,
        [
            "/bin/sh",
            "-c",
            'chmod "$1" "$2" && mv -f "$2" "$3" || { rm -f "$2"; exit 1; }',
            "sh",
            f"{mode:o}",
            tmp,
            path,
        ],
        env={},
        stdin=None,
        timeout=30,
        max_output=4096,
    )
    if done.exit_code != 0:
        why = done.stderr.decode(errors="replace").strip()[-300:]
        raise InvalidArgument(f"cannot write {path} in the guest: {why or done.exit_code}")


async def _close(agent: GuestAgent, handle: int) -> None:
    try:
        await agent.call("guest-file-close", {"handle": handle}, timeout=5)
    except GuestAgentError:
        raise
    except Exception:
        return
