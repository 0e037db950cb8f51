"""The edge side of ``SCMP_ACT_NOTIFY``: answer refused system calls and record them.

crun loads each sandbox's filter with a notify fd and hands that fd over the unix
socket ``listenerPath`` (SCM_RIGHTS, with a JSON state that carries our metadata, the
sandbox id). One thread owns every notify fd: it accepts crun's connections, receives
notifications (``SECCOMP_IOCTL_NOTIF_RECV``), answers EPERM (``..._SEND``) and writes a
``seccomp_violation`` event to the audit sink (thread-safe). A thread, not the event
loop, so that a busy loop never keeps a sandbox's syscall waiting, and one thread
alone opens, polls and closes the fds, so an fd number is never reused under it.

Failure semantics (kernel): when the last copy of a notify fd is closed, every pending
and future notified call of that filter fails with ENOSYS. The edge holds the only
copy (crun closes its own after sending; checked in tests), so if the edge dies the
dangerous calls keep failing, they never hang. A restarted edge cannot re-attach (a
filter's listener is fixed when it is loaded, and a task may carry only one listener):
adopted sandboxes stay confined but their violations are no longer recorded; the
backend notes that in the audit log at adoption.

The notify fd is also the edge's death watch of a sandbox (``ListenerObserver.ended``):
the kernel (>= 5.8, "notify about unused filter") reports EPOLLHUP on it once every
task using the filter has exited, i.e. pid 1 and everything in its pid namespace
(measured on 6.18: at the exit of the last task, before its parent reaps it). And it
carries pid 1's doorbell (``ListenerObserver.doorbell``): pid 1 calls
``reboot(0, 0, DOORBELL, NULL)`` when it holds signal reports and nobody listens
(dsec-init.c, dsec.security.init_signals), so the edge opens that connection only
then. One fd per sandbox for all three jobs.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from dsec.api.events import EventKind
from dsec.security.audit import AuditSink

log = logging.getLogger(__name__)

# <linux/seccomp.h>: _IOWR('!', 0, struct seccomp_notif) etc.
_NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, data.nr, data.arch, data.ip, data.args
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
NOTIF_RECV = 0xC0000000 | (_NOTIF.size << 16) | (ord("!") << 8) | 0
NOTIF_SEND = 0xC0000000 | (_RESP.size << 16) | (ord("!") << 8) | 1

# Events per sandbox and system call within WINDOW seconds; beyond that they are
# counted and the count rides on the next recorded event (a loop of reboot() calls
# must not flood the audit log). Past the burst, each further notification also pauses
# that notify fd for PAUSE seconds, so one sandbox calling reboot() in a loop costs the
# edge at most 1/PAUSE answers a second instead of a core (its callers just wait).
BURST = 10
WINDOW = 10.0
PAUSE = 0.01

# pid 1's doorbell: reboot(0, 0, DOORBELL, NULL) from the sandbox's pid 1 (dsec-init.c).
# The bad magic makes the kernel refuse it before looking at anything else.
DOORBELL = 0x44534543  # 'DSEC'
_REBOOT = "reboot"


class ListenerObserver(Protocol):
    """What the listener tells its owner, on the owner's event loop."""

    def ended(self, sandbox_id: str) -> None:
        """The last notify fd of ``sandbox_id`` hung up: every task of it exited."""

    def doorbell(self, sandbox_id: str) -> None:
        """pid 1 of ``sandbox_id`` holds signal reports and nobody listens."""

    def detached(self, sandbox_id: str) -> None:
        """The listener closed ``sandbox_id``'s notify fd without a hang-up (it stops):
        its end and doorbell are no longer seen here."""


# Kill-family calls the profile flags (dsec.security.seccomp.SIGNAL_CALLS): the index
# of the target and of the signal argument. Kept here so the listener does not import
# the profile module (which imports this one).
SIGNAL_ARGS: dict[str, tuple[int, int]] = {
    "kill": (0, 1),
    "tkill": (0, 1),
    "tgkill": (0, 2),
    "rt_sigqueueinfo": (0, 1),
    "rt_tgsigqueueinfo": (0, 2),
}

_X86_64_NAMES = {
    9: "mmap", 56: "clone", 101: "ptrace", 103: "syslog", 135: "personality",
    155: "pivot_root", 159: "adjtimex", 163: "acct", 164: "settimeofday", 165: "mount",
    166: "umount2", 167: "swapon", 168: "swapoff", 169: "reboot", 170: "sethostname",
    171: "setdomainname", 172: "iopl", 173: "ioperm", 175: "init_module",
    176: "delete_module", 179: "quotactl", 212: "lookup_dcookie", 227: "clock_settime",
    246: "kexec_load", 248: "add_key", 249: "request_key", 250: "keyctl",
    272: "unshare", 298: "perf_event_open", 303: "name_to_handle_at",
    304: "open_by_handle_at", 305: "clock_adjtime", 308: "setns",
    310: "process_vm_readv", 311: "process_vm_writev", 312: "kcmp", 313: "finit_module",
    320: "kexec_file_load", 321: "bpf", 323: "userfaultfd", 428: "open_tree",
    429: "move_mount", 430: "fsopen", 431: "fsconfig", 432: "fsmount", 433: "fspick",
    438: "pidfd_getfd", 442: "mount_setattr", 443: "quotactl_fd", 153: "vhangup",
    62: "kill", 200: "tkill", 234: "tgkill", 129: "rt_sigqueueinfo",
    297: "rt_tgsigqueueinfo", 447: "memfd_secret",
}  # fmt: skip


class _SyscallNames:
    """Syscall number -> name through libseccomp (exact for every arch), with a small
    built-in table when the library is missing."""

    def __init__(self) -> None:
        self._resolve: Any = None
        self._cache: dict[tuple[int, int], str] = {}
        name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(name)
            fn = lib.seccomp_syscall_resolve_num_arch
            fn.argtypes = [ctypes.c_uint32, ctypes.c_int]
            fn.restype = ctypes.c_void_p  # malloc'd char*, freed below
            self._free = ctypes.CDLL(None).free
            self._free.argtypes = [ctypes.c_void_p]
            self._resolve = fn

    def __call__(self, arch: int, nr: int) -> str:
        key = (arch, nr)
        name = self._cache.get(key)
        if name is None:
            name = _X86_64_NAMES.get(nr, f"syscall_{nr}") if arch == 0xC000003E else None
            if self._resolve is not None:
                ptr = self._resolve(arch, nr)
                if ptr:
                    name = ctypes.string_at(ptr).decode()
                    self._free(ptr)
            name = name or f"syscall_{nr}"
            self._cache[key] = name
        return name


# How long crun may take to send a notify fd after connecting. The listener never waits
# for one: each connection is its own entry in the thread's epoll set, so a crun stalled
# under load (a whole 10,000-sandbox run at load 16 lost creates to a 2 s blocking read,
# which also held every sandbox's notifications) delays only its own create.
HANDOFF_TIMEOUT = 60.0


class _Handoff:
    """One connection from crun, read as it becomes readable: the JSON state (with our
    sandbox id as metadata) and the notify fd (SCM_RIGHTS), until EOF or a complete
    JSON message."""

    def __init__(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.conn = conn
        self.data = bytearray()
        self.fds: list[int] = []
        self.deadline = time.monotonic() + HANDOFF_TIMEOUT

    def read(self) -> bool:
        """Take what has arrived; True once the message is whole (EOF or complete
        JSON). Raises OSError for a connection to drop (the fds it brought are closed)."""
        fds = array.array("i")
        try:
            while True:
                try:
                    # CLOEXEC at once: a process spawned meanwhile by another thread
                    # must not get it.
                    msg, anc, flags, _addr = self.conn.recvmsg(
                        65536, socket.CMSG_SPACE(8 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
                    )
                except (BlockingIOError, InterruptedError):
                    return False
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                if flags & socket.MSG_CTRUNC:  # the kernel dropped the fd: no slot for it
                    raise OSError(errno.EMFILE, "the notify fd was dropped (no free fd for it)")
                if not msg:
                    return True
                self.data += msg
                if len(self.data) > 1 << 20 or _complete(self.data):
                    return True
        finally:
            self.fds += list(fds)

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        """Close the connection and any fd not taken."""
        for fd in self.take_fds():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.conn.close()


def _complete(data: bytes | bytearray) -> bool:
    try:
        json.loads(bytes(data).rstrip(b"\0"))
    except ValueError:
        return False
    return True


def _proc_info(pid: int) -> dict[str, Any]:
    """comm and the pid as the sandbox sees it (best effort: the task may be
    gone, and none of it is trusted for a decision, only for the record)."""
    info: dict[str, Any] = {"host_pid": pid}
    with contextlib.suppress(OSError):
        info["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                info["pid"] = int(line.split()[-1])
                break
    return info


class SeccompListener:
    """Serves the notify fds of every sandbox of one edge from one thread."""

    def __init__(self, socket_path: Path, audit: AuditSink) -> None:
        self.socket_path = socket_path
        self.audit = audit
        self._names = _SyscallNames()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._forget: deque[str] = deque()
        self._stop = False
        self._fds: dict[int, str] = {}  # notify fd -> sandbox id (owned by the thread)
        self._handoffs: dict[int, _Handoff] = {}  # crun's connections being read
        self._by_sandbox: dict[str, set[int]] = {}
        self._seen = threading.Lock()
        self._attached: set[str] = set()
        self._rate: dict[tuple[str, str], list[float]] = {}
        self._paused: dict[int, float] = {}  # notify fd -> monotonic time to resume
        self._suppressed: dict[tuple[str, str], int] = {}
        self._accept_paused_until = 0.0  # accept failed for want of fds: retry then
        self._sock_ino = 0  # the inode of our socket file (a removed one is re-bound)
        self._rebind = False
        self._reserve = -1  # one fd held back so that a notify fd can always be received
        self.answered = 0
        self.accept_failures = 0
        self.doorbells = 0
        self._observer: ListenerObserver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def observe(self, loop: asyncio.AbstractEventLoop, observer: ListenerObserver) -> None:
        """Tell ``observer`` (on ``loop``) of sandbox ends, doorbells and detaches."""
        self._loop, self._observer = loop, observer

    def _post(self, what: str, sandbox_id: str) -> None:
        """Call the observer's ``what`` on its loop (from the listener thread)."""
        loop, observer = self._loop, self._observer
        if loop is None or observer is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(getattr(observer, what), sandbox_id)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._sock = self._bind()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._take_reserve()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dsec-seccomp", daemon=True)
        self._thread.start()

    def _take_reserve(self) -> None:
        if self._reserve < 0:
            with contextlib.suppress(OSError):
                self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _spend_reserve(self) -> None:
        """Free the reserved slot for the fd about to arrive (the libuv EMFILE trick):
        accepting used the last free one, and SCM_RIGHTS drops an fd it has no slot
        for, which would leave a sandbox unmonitored."""
        if self._reserve >= 0:
            with contextlib.suppress(OSError):
                os.close(self._reserve)
            self._reserve = -1

    def _bind(self) -> socket.socket:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
            self._sock_ino = os.stat(self.socket_path).st_ino
        except BaseException:
            sock.close()
            raise
        return sock

    # -- supervision (dsec.supervise) ----------------------------------------------------
    def healthy(self) -> str | None:
        """None while creates can attach, else why not: the thread died, or the socket
        file crun connects to is gone or replaced (a cleaned-up run dir)."""
        if self._thread is None:
            return None  # not started or closed on purpose
        if not self._thread.is_alive():
            return "the seccomp listener thread died"
        try:
            ino = os.stat(self.socket_path).st_ino
        except FileNotFoundError:
            return f"the seccomp socket {self.socket_path} is gone"
        except OSError:
            return None  # cannot tell (e.g. out of fds): not a reason to restart
        if ino != self._sock_ino:
            return f"the seccomp socket {self.socket_path} was replaced"
        return None

    def restart(self) -> None:
        """Bring the listener back: a dead thread is started again (sandboxes attached
        before keep their filter; their violations now get ENOSYS, as after a crash); a
        lost socket file is bound again by the running thread, which keeps its fds."""
        if self._thread is None:
            return
        if not self._thread.is_alive():
            self.close()
            self.start()
            return
        self._rebind = True
        self._wake()

    def close(self) -> None:
        """Stop the thread and close every notify fd (their sandboxes' dangerous calls
        then fail with ENOSYS, the same as after a crash)."""
        if self._thread is None:
            return
        self._stop = True
        self._wake()
        self._thread.join(5)
        self._thread = None
        self._by_sandbox.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._spend_reserve()

    def forget(self, sandbox_id: str) -> None:
        """Close a sandbox's notify fds (on teardown; the thread does the closing)."""
        self._forget.append(sandbox_id)
        self._wake()

    def attached(self, sandbox_id: str) -> bool:
        with self._seen:
            return sandbox_id in self._attached

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def open_fds(self) -> int:
        return len(self._fds)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        assert self._sock is not None
        ep = select.epoll()
        try:
            ep.register(self._sock.fileno(), select.EPOLLIN)
            ep.register(self._wake_r, select.EPOLLIN)
            failures = 0
            while not self._stop:
                try:
                    self._step(ep)
                    failures = 0
                except Exception as exc:  # one bad turn must not end the listener
                    failures += 1
                    if failures == 1:
                        log.warning("seccomp listener: %s: %s; going on", type(exc).__name__, exc)
                    time.sleep(min(1.0, 0.01 * 2**failures))
        except Exception:
            log.exception("seccomp listener thread failed; notified calls now get ENOSYS")
        finally:
            # Nobody answers from here on: close every notify fd, so that the sandboxes'
            # dangerous calls fail at once (ENOSYS) instead of waiting for an answer.
            for fd in list(self._handoffs):
                self._end_handoff(ep, fd, adopt=False)
            gone = set(self._fds.values())
            for fd in list(self._fds):
                self._close_fd(ep, fd)
            with self._seen:
                self._attached.clear()
            for sid in gone:
                self._post("detached", sid)
            ep.close()

    def _step(self, ep: select.epoll) -> None:
        assert self._sock is not None
        if self._rebind:
            self._rebind = False
            self._swap_socket(ep)
        self._drain_forget(ep)
        timeout = self._resume(ep)
        if self._handoffs:
            timeout = min(timeout, self._expire_handoffs(ep, time.monotonic()))
        try:
            ready = ep.poll(timeout)
        except InterruptedError:
            return
        for fd, mask in ready:
            if fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif fd == self._sock.fileno():
                self._accept(ep)
            elif fd in self._fds:
                self._serve(ep, fd, mask)
            elif fd in self._handoffs:
                self._read_handoff(ep, fd)

    def _swap_socket(self, ep: select.epoll) -> None:
        """Bind the socket file again (it was removed or replaced under us)."""
        new = self._bind()
        old, self._sock = self._sock, new
        if old is not None:
            with contextlib.suppress(OSError):
                ep.unregister(old.fileno())
            old.close()
        ep.register(new.fileno(), select.EPOLLIN)
        self._accept_paused_until = 0.0
        log.warning("seccomp listener: bound %s again", self.socket_path)

    def _resume(self, ep: select.epoll) -> float:
        """Re-arm paused fds whose pause is over; seconds until the next one is due."""
        now = time.monotonic()
        wait = 1.0
        if self._accept_paused_until:
            if self._accept_paused_until <= now and self._sock is not None:
                self._accept_paused_until = 0.0
                with contextlib.suppress(OSError):
                    ep.register(self._sock.fileno(), select.EPOLLIN)
            else:
                wait = max(0.0, self._accept_paused_until - now)
        if not self._paused:
            return wait
        for fd, until in list(self._paused.items()):
            if until <= now:
                del self._paused[fd]
                if fd in self._fds:
                    ep.register(fd, select.EPOLLIN)
        return min([wait, *(u - now for u in self._paused.values())])

    def _drain_forget(self, ep: select.epoll) -> None:
        while self._forget:
            sid = self._forget.popleft()
            for fd in self._by_sandbox.pop(sid, set()):
                self._close_fd(ep, fd)
            with self._seen:
                self._attached.discard(sid)
            for key in [k for k in self._rate if k[0] == sid]:
                self._rate.pop(key, None)
                self._suppressed.pop(key, None)

    def _close_fd(self, ep: select.epoll, fd: int) -> None:
        sid = self._fds.pop(fd, None)
        self._paused.pop(fd, None)
        with contextlib.suppress(OSError):
            ep.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        if sid is not None:
            left = self._by_sandbox.get(sid)
            if left is not None:
                left.discard(fd)
                if not left:
                    del self._by_sandbox[sid]

    def _accept(self, ep: select.epoll) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # Out of fds (or memory): the connection waits in the backlog. Stop
                # polling the socket for a moment instead of spinning on it; the create
                # that sent it fails on its own and is typed by the edge (dsec.exhaustion).
                self.accept_failures += 1
                if self.accept_failures == 1 or self.accept_failures % 1000 == 0:
                    log.warning(
                        "seccomp listener: accept: %s (%d times); retrying",
                        exc.strerror,
                        self.accept_failures,
                    )
                with contextlib.suppress(OSError):
                    ep.unregister(self._sock.fileno())
                self._accept_paused_until = time.monotonic() + 0.1
                return
            handoff = _Handoff(conn)
            self._handoffs[conn.fileno()] = handoff
            ep.register(conn.fileno(), select.EPOLLIN)
            self._read_handoff(ep, conn.fileno())  # usually all there already

    def _read_handoff(self, ep: select.epoll, fd: int) -> None:
        handoff = self._handoffs[fd]
        self._spend_reserve()
        try:
            if handoff.read():
                self._end_handoff(ep, fd)
        except OSError as exc:
            log.warning("seccomp listener: bad connection: %s", exc)
            self._end_handoff(ep, fd, adopt=False)
        finally:
            self._take_reserve()

    def _end_handoff(self, ep: select.epoll, fd: int, *, adopt: bool = True) -> None:
        handoff = self._handoffs.pop(fd, None)
        if handoff is None:
            return
        with contextlib.suppress(OSError):
            ep.unregister(fd)
        if adopt and handoff.fds:
            self._adopt_fds(ep, bytes(handoff.data), handoff.take_fds())
        handoff.close()

    def _expire_handoffs(self, ep: select.epoll, now: float) -> float:
        """Drop connections that sent nothing whole in HANDOFF_TIMEOUT (their create
        fails in crun and is reported by the edge); seconds until the next deadline."""
        wait = HANDOFF_TIMEOUT
        for fd, handoff in list(self._handoffs.items()):
            if handoff.deadline <= now:
                log.warning("seccomp listener: crun sent no notify fd in %g s", HANDOFF_TIMEOUT)
                self._end_handoff(ep, fd, adopt=False)
            else:
                wait = min(wait, handoff.deadline - now)
        return wait

    def _adopt_fds(self, ep: select.epoll, data: bytes, fds: list[int]) -> None:
        sid = _sandbox_of(data)
        if sid is None or len(fds) != 1:
            log.warning("seccomp listener: unexpected message (%d fds): %r", len(fds), data[:200])
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            return
        fd = fds[0]
        self._fds[fd] = sid
        self._by_sandbox.setdefault(sid, set()).add(fd)
        ep.register(fd, select.EPOLLIN)
        with self._seen:
            self._attached.add(sid)

    def _serve(self, ep: select.epoll, fd: int, mask: int) -> None:
        if mask & select.EPOLLIN:
            buf = bytearray(_NOTIF.size)  # must be zeroed: the kernel checks
            try:
                fcntl.ioctl(fd, NOTIF_RECV, buf, True)
            except OSError as exc:
                # ENOENT: the caller died (or was signalled) between poll and recv.
                if exc.errno not in (errno.ENOENT, errno.EINTR):
                    log.warning("seccomp notif recv: %s", exc)
            else:
                if not self._answer(fd, buf):
                    with contextlib.suppress(OSError):
                        ep.unregister(fd)
                    self._paused[fd] = time.monotonic() + PAUSE
                return
        if mask & (select.EPOLLHUP | select.EPOLLERR):
            # Every task of the filter is gone: the sandbox ended. Told once its last
            # fd goes (a verifier's filter reports under the sandbox it grades).
            sid = self._fds.get(fd)
            self._close_fd(ep, fd)
            if sid is not None and sid not in self._by_sandbox:
                with self._seen:
                    self._attached.discard(sid)
                self._post("ended", sid)

    def _answer(self, fd: int, buf: bytearray) -> bool:
        """Refuse the call with EPERM; False if it was over the sandbox's burst."""
        nid, pid, _flags, nr, arch, _ip, *args = _NOTIF.unpack(buf)
        sid = self._fds.get(fd, "?")
        name = self._names(arch, nr)
        if name == _REBOOT and _is_doorbell(pid, args):
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, NOTIF_SEND, bytearray(_RESP.pack(nid, 0, -errno.EPERM, 0)), True)
            self.doorbells += 1
            self._post("doorbell", sid)
            return True
        record = self._admit(sid, name)
        # Read /proc while the caller waits in the call (it cannot exit meanwhile).
        who = _proc_info(pid) if record else {}
        resp = bytearray(_RESP.pack(nid, 0, -errno.EPERM, 0))
        with contextlib.suppress(OSError):  # ENOENT: the caller is gone; nothing to answer
            fcntl.ioctl(fd, NOTIF_SEND, resp, True)
        self.answered += 1
        if not record:
            return False
        detail: dict[str, Any] = {
            "syscall": name,
            "nr": nr,
            "args": [hex(a) for a in args],
            "result": "EPERM",
            **who,
        }
        dropped = self._suppressed.pop((sid, name), 0)
        if dropped:
            detail["suppressed_before"] = dropped
        kind = EventKind.SECCOMP_VIOLATION
        where = SIGNAL_ARGS.get(name)
        if where is not None:
            # Only signals at pid 1 (or kill(-1)) are flagged by the profile.
            kind = EventKind.SIGNAL_TO_INIT
            target, sig = _int32(args[where[0]]), _int32(args[where[1]])
            detail.update(
                target=target, signal=signal_name(sig), signo=sig, via="seccomp", action="refused"
            )
        self.audit.event(sid, kind, **detail)
        return True

    def _admit(self, sid: str, name: str) -> bool:
        now = time.monotonic()
        key = (sid, name)
        times = [t for t in self._rate.get(key, []) if now - t < WINDOW]
        if len(times) >= BURST:
            self._rate[key] = times
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        times.append(now)
        self._rate[key] = times
        return True


def _is_doorbell(pid: int, args: list[int]) -> bool:
    """reboot(0, 0, DOORBELL, ...) from a pid 1 of its namespace (the kernel's word:
    the notification's pid and /proc; a sandbox's other processes cannot pose as it,
    and their reboot() is a violation as ever)."""
    if args[0] != 0 or args[1] != 0 or args[2] & 0xFFFFFFFF != DOORBELL:
        return False
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] == "1"
    except OSError:
        return False
    return False


def _int32(value: int) -> int:
    """What the kernel makes of a pid or signal argument: its low 32 bits, signed."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def signal_name(signo: int) -> str:
    """``SIGTERM`` for 15, ``SIGRTMIN+3`` for real-time signals, else the number."""
    with contextlib.suppress(ValueError):
        return signal.Signals(signo).name
    if signal.SIGRTMIN <= signo <= signal.SIGRTMAX:
        return f"SIGRTMIN+{signo - signal.SIGRTMIN}"
    return str(signo)


def _sandbox_of(data: bytes) -> str | None:
    """The sandbox id in crun's message: ``metadata`` (we set it), else ``state.id``;
    older crun versions send the bare metadata string."""
    text = data.decode(errors="replace").strip().rstrip("\0")
    if not text:
        return None
    try:
        msg = json.loads(text)
    except ValueError:
        return text if text.replace("-", "").isalnum() else None
    if isinstance(msg, dict):
        meta = msg.get("metadata")
        if isinstance(meta, str) and meta:
            return meta
        state = msg.get("state")
        if isinstance(state, dict) and isinstance(state.get("id"), str):
            return str(state["id"])
    return None
