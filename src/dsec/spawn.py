"""Start helper processes cheaply from a large asyncio process.

asyncio's (and uvloop's) subprocess support forks the whole interpreter: with the
platform's ~80 MB resident that costs ~4 ms per spawn, measured, plus copy-on-write
faults afterwards. ``posix_spawn`` uses vfork (~0.6 ms) and a pidfd tells the event
loop when the child exits, without a thread per child. Output goes to a memfd that is
read once the child is gone, so no pipe can stall the child or us (and a daemonising
child that keeps our stdout open cannot make us wait forever).

When a spawner is configured (``use_spawner``), the agent binary's ``spawner`` mode
starts the processes instead: a tiny per-host subreaper that outlives the platform, so
the orphans of what it starts (crun's intermediates, container inits) are still reaped
after the platform crashed and restarted. This machine's pid 1 never reaps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from dsec import linux

log = logging.getLogger(__name__)

# Children that run() waits for itself; the orphan reaper must leave them alone.
_owned: set[int] = set()

# The spawner's socket when one is in use (see use_spawner). The wire format mirrors
# spawner_main() in src/dsec/agent/dsec-init.c.
_spawner: Path | None = None
_OP_RUN, _OP_SHUTDOWN, _OP_STATUS = 1, 2, 3
_PID, _EXIT, _BYE, _UNKNOWN = 1, 2, 3, 4
# The wait statuses of the last orphans reap_orphans() collected (pid -> raw status),
# what reaped_status() answers without a spawner; the spawner keeps its own ring.
_RING = 1024
# How long a stop waits for the spawner to reap its last child and exit: the inits of
# the sandboxes just stopped die within ms; one still alive after this is logged.
SPAWNER_DRAIN_S = 10.0
_reaped: dict[int, int] = {}
_HEADER = struct.Struct("<IiII")
_REPLY = struct.Struct("<ii")


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
        conn = _connect() if _spawner is not None else None
        if conn is not None:
            with conn:
                code = await _run_via_spawner(conn, argv, out_fd, err_fd, pass_fd, timeout)
        else:
            code = await _run_here(argv, out_fd, err_fd, pass_fd, timeout)
        return Completed(code, _read_tail(out_fd, output_limit), _read_tail(err_fd, output_limit))
    finally:
        os.close(out_fd)
        os.close(err_fd)


async def _run_here(
    argv: list[str],
    out_fd: int,
    err_fd: int,
    pass_fd: tuple[int, int] | None,
    timeout: float | None,
) -> int:
    """posix_spawn our own child: the fallback when no spawner is in use."""
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
        return await _wait_pidfd(pid, pidfd, timeout)
    finally:
        os.close(pidfd)
        _owned.discard(pid)


def use_spawner(path: Path | None) -> None:
    """Start every run() through the spawner listening on ``path`` (None: posix_spawn)."""
    global _spawner
    _spawner = path


def spawner_answers(path: Path) -> bool:
    """Whether a spawner listens on ``path`` (e.g. one that a crashed platform started)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def spawner_pid(path: Path) -> int | None:
    """The pid of the spawner listening on ``path``, from the socket's peer credentials
    (so also of one a crashed platform started); None when none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(str(path))
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def spawner_children(path: Path) -> list[int] | None:
    """The living processes the spawner on ``path`` is the parent of (sandbox inits,
    crun's intermediates it adopted as subreaper); None when no spawner answers or its
    children cannot be read. Its pid comes from the socket's peer credentials, so this
    also works for a spawner a crashed platform started. A dead child not reaped yet
    (its SIGCHLD merged into another's and the sweep not due) does not count: a
    stop reaps it anyway."""
    pid = spawner_pid(path)
    children = None if pid is None else _children_of(pid)
    return None if children is None else [c for c in children if not _gone(c, reap=False)]


def stop_spawner(path: Path, timeout: float = 5.0) -> bool:
    """Ask the spawner on ``path`` to exit; True once it acknowledged. It stops
    listening at once, and exits when it has reaped its last child (see ``stop``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        try:
            s.settimeout(timeout)
            s.connect(str(path))
            s.send(_HEADER.pack(_OP_SHUTDOWN, -1, 0, 0))
            reply = s.recv(_REPLY.size)
        except OSError:
            return False
    return len(reply) == _REPLY.size and _REPLY.unpack(reply)[0] == _BYE


def _connect() -> socket.socket | None:
    """A connection to the spawner, or None (logged) to fall back to posix_spawn: a
    spawner that went away must not fail every runtime call (we are a subreaper too)."""
    assert _spawner is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        # A unix connect completes at once (or fails); it never waits for the peer.
        s.setblocking(False)
        s.connect(str(_spawner))
    except OSError as exc:
        s.close()
        log.warning("spawner at %s unavailable (%s); using posix_spawn", _spawner, exc)
        return None
    return s


async def _readable(sock: socket.socket, timeout: float | None) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        # asyncio.timeout, not wait_for: no extra waiter and callbacks (twice a create)
        async with asyncio.timeout(timeout):
            await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _reply(sock: socket.socket, timeout: float | None) -> tuple[int, int]:
    while True:
        try:
            data = sock.recv(_REPLY.size)
        except BlockingIOError:
            await _readable(sock, timeout)
            continue
        if len(data) != _REPLY.size:
            raise ConnectionError("the spawner closed the connection")
        kind, value = _REPLY.unpack(data)
        return kind, value


def _kill_unannounced(sock: socket.socket) -> None:
    """Cancelled (or timed out) before the pid arrived: the child may run already, and
    the spawner answers right after starting it, so wait briefly for the pid and kill."""
    with contextlib.suppress(OSError, struct.error):
        sock.settimeout(1.0)
        kind, pid = _REPLY.unpack(sock.recv(_REPLY.size))
        if kind == _PID and pid > 0:
            os.kill(pid, signal.SIGKILL)


async def _run_via_spawner(
    sock: socket.socket,
    argv: list[str],
    out_fd: int,
    err_fd: int,
    pass_fd: tuple[int, int] | None,
    timeout: float | None,
) -> int:
    """One request: the spawner answers with the pid, then with the wait status."""
    env = [f"{k}={v}" for k, v in os.environ.items()]
    strings = b"".join(os.fsencode(a) + b"\0" for a in [*argv, *env])
    target = -1 if pass_fd is None else pass_fd[1]
    fds = [out_fd, err_fd] if pass_fd is None else [out_fd, err_fd, pass_fd[0]]
    header = _HEADER.pack(_OP_RUN, target, len(argv), len(env))
    # One datagram into an idle local socket: it does not block.
    socket.send_fds(sock, [header + strings], fds)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    try:
        kind, pid = await _reply(sock, timeout)
    except BaseException:
        _kill_unannounced(sock)
        raise
    if kind != _PID:
        raise ConnectionError(f"unexpected reply {kind} from the spawner")
    if pid < 0:
        raise OSError(-pid, os.strerror(-pid), argv[0])
    try:
        pidfd: int | None = os.pidfd_open(pid)  # kills exactly this process, never a reuse
    except ProcessLookupError:
        pidfd = None  # already exited and reaped: its status is on the way
    try:
        left = None if deadline is None else max(0.0, deadline - loop.time())
        kind, status = await _reply(sock, left)
    except BaseException:
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        raise
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if kind != _EXIT:
        raise ConnectionError(f"unexpected reply {kind} from the spawner")
    return os.waitstatus_to_exitcode(status)


def _comm(pid: int) -> str | None:
    st = linux.proc_stat(pid)
    return None if st is None else st.comm


def reap_orphans(names: frozenset[str]) -> int:
    """Reap zombie children called one of ``names`` that we did not start ourselves.

    A subreaper inherits the orphans of what it starts (crun's intermediate process,
    every container's init). Nobody else waits for them, and this machine's pid 1
    does not reap either, so without this each sandbox would leave a zombie. We peek
    with WNOWAIT and stop at the first zombie that is someone else's (asyncio's, or
    one run() is about to collect): it goes away on its own, and we retry later.
    With a spawner in use, only its fallback path and a spawner that exited leave
    orphans here.
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
            pid, status = os.waitpid(info.si_pid, os.WNOHANG)
            if pid:
                _reaped.pop(pid, None)  # the newest status of a pid is the one kept
                _reaped[pid] = status
                if len(_reaped) > _RING:
                    del _reaped[next(iter(_reaped))]
        reaped += 1


async def reaped_status(pid: int, timeout: float = 1.0) -> int | None:
    """The raw wait status of ``pid``, an orphan (a sandbox's init) that was reaped
    lately by the spawner or by reap_orphans(); None when neither knows it (not reaped
    yet, or long ago). How the edge says how an init died without a pidfd per sandbox."""
    if _spawner is None:
        return _reaped.get(pid)
    sock = _connect()
    if sock is None:
        return _reaped.get(pid)
    with sock:
        try:
            sock.send(_HEADER.pack(_OP_STATUS, pid, 0, 0))
            kind, value = await _reply(sock, timeout)
        except (OSError, TimeoutError):
            return _reaped.get(pid)
    return value if kind == _EXIT else _reaped.get(pid)


def _gone(pid: int, *, reap: bool) -> bool:
    """Whether ``pid`` has exited: reaped here when ``reap`` (our child), else gone or a
    zombie (a crashed platform's spawner is pid 1's child now, and pid 1 reaps late)."""
    if reap:
        try:
            return os.waitpid(pid, os.WNOHANG) != (0, 0)
        except ChildProcessError:
            return True
    return not linux.pid_alive(pid)


def _children_of(pid: int) -> list[int] | None:
    """The children of ``pid`` (every thread's), or None when they cannot be read."""
    children: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/children", encoding="ascii") as fh:
                children += [int(c) for c in fh.read().split()]
    except OSError:
        return None
    return children


@dataclass
class HostSpawner:
    """The spawner this platform uses; ``pid`` is set when we started it (our child)."""

    path: Path
    pid: int | None

    def stop_if_idle(self) -> bool:
        """``stop`` when no living process is left for it to reap (a clean shutdown
        whose sandboxes all ended, though they were free to run on): a spawner outlives the
        platform only for the sandboxes that do. True if it was stopped; kept when
        its children cannot be read (a kernel without /proc/PID/task/TID/children):
        a spawner left running is harmless, a sandbox without its reaping parent not."""
        children = spawner_children(self.path)
        if children is None or children:
            return False
        self.stop()
        return True

    def stop(self, drain_timeout: float = SPAWNER_DRAIN_S) -> None:
        """Make it exit once it has reaped every child, and wait for that (bounded).

        The platform stops it right after stopping its sandboxes, whose inits may not
        be reaped yet; a spawner that left then would hand them to pid 1, which here
        never reaps. So it drains first (dsec-init.c, sp_drain), and we wait for it
        to be gone, also when a crashed platform started it (not our child). A child
        that outlives ``drain_timeout`` keeps it running, as its reaping parent: it is
        logged, never killed. Only a spawner that does not answer is killed, if ours."""
        use_spawner(None)
        pid = self.pid if self.pid is not None else spawner_pid(self.path)
        if not stop_spawner(self.path):
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                self.pid = None
            return
        deadline = time.monotonic() + drain_timeout
        while pid is not None and not _gone(pid, reap=pid == self.pid):
            if time.monotonic() > deadline:
                log.warning(
                    "the spawner (pid %d) still reaps %s after %.0f s: left running",
                    pid,
                    _children_of(pid),
                    drain_timeout,
                )
                return
            time.sleep(0.01)
        self.pid = None


async def start_spawner(binary: Path, path: Path, timeout: float = 10.0) -> HostSpawner:
    """Use the spawner on ``path``: the one a crashed platform left running (it is the
    parent of that platform's sandboxes), or a new one started from ``binary``."""
    if not spawner_answers(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        pid = os.posix_spawn(  # noqa: ASYNC221 - vfork + exec, once at startup
            str(binary),
            [str(binary), "spawner", str(path)],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            ],
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not spawner_answers(path):
            exited = os.waitpid(pid, os.WNOHANG) != (0, 0)  # noqa: ASYNC222 - WNOHANG
            if exited or loop.time() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)  # noqa: ASYNC222 - SIGKILLed: returns at once
                raise RuntimeError(f"the spawner did not start listening on {path}")
            await asyncio.sleep(0.005)
        spawner = HostSpawner(path, pid)
    else:
        log.info("re-using the running spawner on %s", path)
        spawner = HostSpawner(path, None)
    use_spawner(path)
    return spawner
