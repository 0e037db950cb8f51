"""Notice at once when a sandbox's init dies, however it dies (killed from the host,
an OOM kill, a crash of the agent), and say how.

Without this a sandbox whose init was killed read ``running`` until the next request
happened to fail. Here each running sandbox's init has a pidfd in the edge's event
loop (epoll: one fd per sandbox, nothing per poll), which becomes readable when the
process exits. The init is not our child (the host spawner reaps it, dsec.spawn), so
``waitpid`` cannot tell its status; ``PIDFD_GET_INFO`` (Linux 6.15) can, once the
spawner reaped it, which takes it microseconds: we ask a few times, briefly. On an
older kernel, or if the status never shows, the death is reported without it.

A pidfd costs the edge an fd per sandbox, and its fd limit bounds how many sandboxes
fit (dsec.resources.capacity). Where the backend already holds a connection to the init
that ends when the init does (a container's pid 1 signal-report connection,
dsec.security.init_signals), the watch is *passive*: no pidfd, the backend tells
``closed()`` when that connection ends, and only then is the init looked at. Gone: its
status comes from whoever reaped it (dsec.spawn.reaped_status). Still there (the
connection ended first, e.g. a pid 1 that closed it, or an init on its way out): a
pidfd watches it from then on, so no death goes unnoticed either way.

fds are bounded: at most a third of the soft ``nofile`` limit is spent on pidfds, so
the data path keeps its own; beyond that (or on EMFILE) a sandbox is not watched, and
its death is noticed as before, by the next request that fails (logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import signal
import struct
from collections.abc import Callable

from dsec import linux, spawn

log = logging.getLogger(__name__)

# linux/pidfd.h: struct pidfd_info (the first 64 bytes, PIDFD_INFO_SIZE_VER0).
_INFO = struct.Struct("<QQ11Ii")
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_GET_INFO = (3 << 30) | (_INFO.size << 16) | (0xFF << 8) | 11  # _IOWR(0xFF, 11, ...)
# The spawner reaps at once; without one, our own reaper passes every 0.5 s.
_STATUS_TRIES = (0.0, 0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.3)


def exit_status(pidfd: int) -> int | None:
    """The raw wait status of a reaped process, from its pidfd; None if not (yet) known."""
    buf = bytearray(_INFO.size)
    struct.pack_into("<Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    fields = _INFO.unpack(buf)
    return fields[-1] if fields[0] & _PIDFD_INFO_EXIT else None


def _start_time(pid: int) -> int | None:
    """The process's start time (a zombie's too): tells a pid's reuse."""
    st = linux.proc_stat(pid)
    return None if st is None else st.start_time


def describe(status: int | None) -> str:
    """``killed by SIGKILL`` / ``exited with status 3`` / ``exit status unknown``."""
    if status is None:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"wait status {status:#x}"


class InitWatcher:
    """One pidfd per watched init; ``on_death(sandbox_id, pid, wait_status)`` when it
    dies (the pid, so that a sandbox whose init changed meanwhile, a microVM resumed
    into a new VMM process, can tell an old init's death from its current one's)."""

    def __init__(self, on_death: Callable[[str, int, int | None], None]) -> None:
        self.on_death = on_death
        self._fds: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._passive: dict[str, tuple[int, int | None]] = {}  # sid -> (pid, start time)
        self._tasks: set[asyncio.Task[None]] = set()
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.max_watched = (
            soft // 3 if soft != resource.RLIM_INFINITY else 1 << 20
        )  # the rest for sockets, files, seccomp listeners
        self.unwatched = 0  # sandboxes beyond the budget or without a pidfd

    @property
    def watched(self) -> int:
        return len(self._fds) + len(self._passive)

    @property
    def pidfds(self) -> int:
        """fds held: one per init watched actively."""
        return len(self._fds)

    def watch(self, sandbox_id: str, pid: int, *, passive: bool = False) -> bool:
        """Watch ``pid``, the init of ``sandbox_id``; False if it cannot be (no fd
        left, or the process is already gone: then ``on_death`` is called soon).
        ``passive``: the caller's backend holds a connection that ends with the init
        and calls ``closed()`` then (module doc); no fd is spent until it does."""
        self.forget(sandbox_id)
        if passive:
            start = _start_time(pid)
            if start is not None:
                self._passive[sandbox_id] = (pid, start)
                return True
        if len(self._fds) >= self.max_watched:
            self._not_watched(sandbox_id, f"more than {self.max_watched} pidfds")
            return False
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._report(sandbox_id, pid, None)
            return False
        except OSError as exc:  # EMFILE/ENFILE, or no pidfds at all
            self._not_watched(sandbox_id, str(exc))
            return False
        self._fds[sandbox_id] = fd
        self._pids[sandbox_id] = pid
        asyncio.get_running_loop().add_reader(fd, self._exited, sandbox_id)
        return True

    def _not_watched(self, sandbox_id: str, why: str) -> None:
        if self.unwatched == 0:
            log.warning(
                "the init of %s is not watched (%s): deaths of such sandboxes are noticed "
                "by their next request",
                sandbox_id,
                why,
            )
        self.unwatched += 1

    def closed(self, sandbox_id: str) -> None:
        """The backend's connection to the init of a passively watched sandbox ended:
        report the init's death if it is gone, else watch it with a pidfd."""
        entry = self._passive.pop(sandbox_id, None)
        if entry is None:
            return  # not watched passively (a verifier, or already forgotten)
        pid, start = entry
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        except OSError as exc:
            self._not_watched(sandbox_id, str(exc))
            return
        if fd is not None and _start_time(pid) != start:
            os.close(fd)  # the pid was reused: ours is gone
            fd = None
        if fd is None:
            task = asyncio.get_running_loop().create_task(self._reaped(sandbox_id, pid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._fds[sandbox_id] = fd
        self._pids[sandbox_id] = pid
        asyncio.get_running_loop().add_reader(fd, self._exited, sandbox_id)

    async def _reaped(self, sandbox_id: str, pid: int) -> None:
        """An init already gone: how it died, from its reaper (briefly retried)."""
        status: int | None = None
        for delay in _STATUS_TRIES:
            if delay:
                await asyncio.sleep(delay)
            status = await spawn.reaped_status(pid)
            if status is not None:
                break
        self._report(sandbox_id, pid, status)

    def forget(self, sandbox_id: str) -> None:
        """Stop watching (before the edge kills the sandbox itself)."""
        self._passive.pop(sandbox_id, None)
        fd = self._fds.pop(sandbox_id, None)
        self._pids.pop(sandbox_id, None)
        if fd is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _exited(self, sandbox_id: str) -> None:
        fd = self._fds.pop(sandbox_id, None)
        pid = self._pids.pop(sandbox_id, 0)
        if fd is None:
            return
        asyncio.get_running_loop().remove_reader(fd)
        task = asyncio.get_running_loop().create_task(self._collect(sandbox_id, pid, fd))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _collect(self, sandbox_id: str, pid: int, fd: int) -> None:
        """Wait briefly for the reaper, so that the record can say how the init died."""
        status: int | None = None
        try:
            for delay in _STATUS_TRIES:
                if delay:
                    await asyncio.sleep(delay)
                status = exit_status(fd)
                if status is not None:
                    break
        finally:
            os.close(fd)
        self._report(sandbox_id, pid, status)

    def _report(self, sandbox_id: str, pid: int, status: int | None) -> None:
        try:
            self.on_death(sandbox_id, pid, status)
        except Exception:
            log.exception("handling the death of %s failed", sandbox_id)

    async def close(self) -> None:
        self._passive.clear()
        for sid in list(self._fds):
            self.forget(sid)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
