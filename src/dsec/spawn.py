"""Start helper processes cheaply from a large asyncio process.

asyncio's (and uvloop's) subprocess support forks the whole interpreter: with the
platform's ~80 MB resident that costs ~4 ms per spawn, measured, plus copy-on-write
faults afterwards. ``posix_spawn`` uses vfork (~0.6 ms) and a pidfd tells the event
loop when the child exits, without a thread per child. Output goes to a memfd that is
read once the child is gone, so no pipe can stall the child or us (and a daemonising
child that keeps our stdout open cannot make us wait forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

# Children that run() waits for itself; the orphan reaper must leave them alone.
_owned: set[int] = set()


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


async def _wait_pidfd(pid: int, pidfd: int, timeout: float | None) -> int:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def exited() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, exited)
    try:
        await asyncio.wait_for(done, timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # noqa: ASYNC222 - SIGKILLed: returns at once
        raise
    finally:
        loop.remove_reader(pidfd)
    _pid, status = os.waitpid(pid, 0)  # noqa: ASYNC222 - the pidfd says it exited
    return os.waitstatus_to_exitcode(status)


def _read_tail(fd: int, limit: int) -> str:
    size = os.fstat(fd).st_size
    start = max(0, size - limit)
    return os.pread(fd, size - start, start).decode(errors="replace")


async def run(
    argv: list[str],
    *,
    pass_fd: tuple[int, int] | None = None,
    timeout: float | None = 60.0,
    output_limit: int = 64 * 1024,
) -> Completed:
    """Run ``argv`` to completion, capturing the tail of stdout and stderr.

    ``pass_fd=(fd, target)`` makes our ``fd`` the child's ``target`` (inheritable there
    even if close-on-exec here). Raises TimeoutError after killing the child.
    """
    out_fd = os.memfd_create("dsec-spawn-stdout", os.MFD_CLOEXEC)
    err_fd = os.memfd_create("dsec-spawn-stderr", os.MFD_CLOEXEC)
    try:
        actions: list[tuple[int, int, str, int, int] | tuple[int, int, int]] = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_fd, 1),
            (os.POSIX_SPAWN_DUP2, err_fd, 2),
        ]
        if pass_fd is not None:
            actions.append((os.POSIX_SPAWN_DUP2, pass_fd[0], pass_fd[1]))
        # vfork + exec: blocks only until the child has exec'd (~0.5 ms).
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)  # noqa: ASYNC221
        _owned.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            code = await _wait_pidfd(pid, pidfd, timeout)
        finally:
            os.close(pidfd)
            _owned.discard(pid)
        return Completed(code, _read_tail(out_fd, output_limit), _read_tail(err_fd, output_limit))
    finally:
        os.close(out_fd)
        os.close(err_fd)


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.find("(") + 1 : stat.rfind(")")]


def reap_orphans(names: frozenset[str]) -> int:
    """Reap zombie children called one of ``names`` that we did not start ourselves.

    A subreaper inherits the orphans of what it starts (crun's intermediate process,
    every container's init). Nobody else waits for them, and this machine's pid 1
    does not reap either, so without this each sandbox would leave a zombie. We peek
    with WNOWAIT and stop at the first zombie that is someone else's (asyncio's, or
    one run() is about to collect): it goes away on its own, and we retry later.
    """
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in _owned or _comm(info.si_pid) not in names:
            return reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
        reaped += 1
