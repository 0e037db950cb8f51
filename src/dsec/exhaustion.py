"""Host resources running out: typed at the source, visible in health, cleared alone.

A full data disk, a process out of file descriptors, the kernel out of memory or pids
used to surface as whatever broke first (an SQLite ``OperationalError``, an
``OSError`` from a pipe or a socket, crun's stderr) and became a 500 ``internal`` with
a traceback. Here each of them is recognised where it is raised (:func:`classify`),
turned into a typed error that says what to do (``InsufficientStorage`` 507,
``ResourceExhausted`` 503), and remembered with the time it started (:class:`Exhaustion`),
so that ``/v1/health`` says ``degraded`` and why. Nothing is sticky: every look at the
state probes the resource again (free bytes of the data dir, open fds against
``nofile``, ``MemAvailable``) and forgets what is back, so creates resume by
themselves without a restart.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import resource
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from dsec.errors import DSecError, InsufficientStorage, ResourceExhausted

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# Below this much free space on the data dir a create is refused up front (507): the
# records, the audit log and the WAL need room, and a create that fails half-way on a
# full disk would have to be cleaned up with no room to record that either.
MIN_FREE_BYTES = 16 * MiB
# File descriptors a create needs (pipes, sockets, the runtime's own) at most, about.
FD_HEADROOM = 32
MIN_MEM_AVAILABLE = 32 * MiB
# A resource noted without a probe (pids) is assumed back this long after the last note.
QUIET_CLEARS = 10.0


class Resource(StrEnum):
    DISK = "disk"
    FDS = "fds"
    MEMORY = "memory"
    PIDS = "pids"
    # Sandboxes' writable disks held below their limits: the host cannot back the
    # sparse sandbox disk image (dsec.resources.diskguard). Shown in health; creates go
    # on unless the guard has no useful share left for one (it refuses those itself).
    SANDBOX_DISK = "sandbox_disk"


_ERRNO: dict[int, Resource] = {
    errno.ENOSPC: Resource.DISK,
    errno.EMFILE: Resource.FDS,
    errno.ENFILE: Resource.FDS,
    errno.ENOMEM: Resource.MEMORY,
}
# What runtimes (crun, mkfs, mount) print for the same conditions.
_TEXT: tuple[tuple[str, Resource], ...] = (
    ("no space left on device", Resource.DISK),
    ("database or disk is full", Resource.DISK),
    ("disk i/o error", Resource.DISK),
    ("too many open files", Resource.FDS),
    ("cannot allocate memory", Resource.MEMORY),
    ("out of memory", Resource.MEMORY),
    ("resource temporarily unavailable", Resource.PIDS),  # fork/clone EAGAIN
    ("can't start new thread", Resource.PIDS),  # threading: EAGAIN; see below
)
_THREAD_START = "can't start new thread"
THREAD_STACK = 8 * MiB


def _thread_start_failure() -> Resource:
    """Why a thread could not start: pthread_create says EAGAIN both when clone hits
    pids.max and when the stack cannot be mapped (memory). Map a stack's worth to tell
    (only on this error path)."""
    try:
        mmap.mmap(-1, THREAD_STACK).close()
    except (OSError, MemoryError):
        return Resource.MEMORY
    return Resource.PIDS


ADVICE: dict[Resource, str] = {
    Resource.DISK: "free space on the data dir's file system; creates resume by themselves",
    Resource.FDS: (
        "too many open file descriptors: close idle connections or raise `ulimit -n`; retry shortly"
    ),
    Resource.MEMORY: "the host is out of memory: stop some sandboxes or retry later",
    Resource.PIDS: "the host is out of processes (pids): stop some sandboxes or retry later",
    Resource.SANDBOX_DISK: (
        "free space on the data dir's file system; sandboxes' disk limits come back by themselves"
    ),
}


def classify(exc: BaseException) -> Resource | None:
    """The exhausted resource behind ``exc`` (its cause chain too), or None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError):
            return Resource.MEMORY
        if isinstance(cur, OSError) and cur.errno in _ERRNO:
            return _ERRNO[cur.errno]
        if isinstance(cur, OSError) and cur.errno == errno.EAGAIN and "fork" in str(cur):
            return Resource.PIDS
        if isinstance(cur, sqlite3.Error | DSecError | OSError | RuntimeError):
            text = str(cur).lower()
            for needle, res in _TEXT:
                if needle in text:
                    return _thread_start_failure() if needle == _THREAD_START else res
        cur = cur.__cause__ or cur.__context__
    return None


@dataclass
class Condition:
    resource: Resource
    since: float  # unix time
    last: float  # monotonic time of the last note
    detail: str

    def as_dict(self) -> dict[str, str | float]:
        return {
            "resource": self.resource.value,
            "since": round(self.since, 3),
            "reason": self.detail,
            "what_to_do": ADVICE[self.resource],
        }


class Exhaustion:
    """What is exhausted right now, and since when; thread-safe.

    ``data_dir`` is the file system whose free space gates creates (None: no disk
    probe). Each resource is logged once when it runs out and once when it is back.
    """

    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = data_dir
        self._lock = threading.Lock()
        self._now: dict[Resource, Condition] = {}
        self.noted = 0  # how many failures were typed here (figures for the fault tests)
        self._fds_used = 0
        self._fds_at = -1e9
        self._probes: dict[Resource, Callable[[], str | None]] = {}

    def watch(self, res: Resource, probe: Callable[[], str | None]) -> None:
        """Let the part that owns ``res`` say when it runs short (``probe``: why, or
        None), for health like the rest. Creates are gated by :meth:`check_create`'s
        own resources only (disk, fds, memory)."""
        self._probes[res] = probe

    # -- recording ---------------------------------------------------------------------
    def note(self, res: Resource, detail: str) -> DSecError:
        """Remember that ``res`` ran out (``detail``: what failed); the typed error."""
        with self._lock:
            self.noted += 1
            cond = self._now.get(res)
            if cond is None:
                self._now[res] = Condition(res, time.time(), time.monotonic(), detail[:300])
                log.warning("%s exhausted: %s (%s)", res.value, detail[:300], ADVICE[res])
            else:
                cond.last = time.monotonic()
        return self.error(res, detail)

    @staticmethod
    def error(res: Resource, detail: str) -> DSecError:
        message = f"{res.value} exhausted ({detail[:200]}): {ADVICE[res]}"
        if res is Resource.DISK:
            return InsufficientStorage(message, resource=res.value)
        return ResourceExhausted(message, resource=res.value)

    def typed(self, exc: BaseException) -> DSecError | None:
        """The typed error for ``exc`` if it is an exhaustion (noted), else None."""
        if isinstance(exc, InsufficientStorage | ResourceExhausted):
            return exc
        res = classify(exc)
        if res is None:
            return None
        return self.note(res, f"{type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def mapped(self) -> Iterator[None]:
        """Re-raise an exhaustion inside the block as its typed error (no traceback)."""
        try:
            yield
        except Exception as exc:
            typed = self.typed(exc)
            if typed is None or typed is exc:
                raise
            raise typed from None

    # -- probing -----------------------------------------------------------------------
    def check_create(self) -> None:
        """Refuse a create up front while a probe says it cannot succeed."""
        for res in (Resource.DISK, Resource.FDS, Resource.MEMORY):
            detail = self._probe(res)
            if detail is not None:
                raise self.note(res, detail)

    def _probe(self, res: Resource) -> str | None:
        """Why ``res`` is exhausted now, or None if it looks fine (or cannot be told)."""
        try:
            if res in self._probes:
                return self._probes[res]()
            if res is Resource.DISK and self.data_dir is not None:
                st = os.statvfs(self.data_dir)
                free = st.f_bavail * st.f_frsize
                if free < MIN_FREE_BYTES:
                    return f"{free // 1024} KiB free on {self.data_dir}"
                if st.f_files and st.f_favail == 0:
                    return f"no free inodes on {self.data_dir}"
            elif res is Resource.FDS:
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                if soft != resource.RLIM_INFINITY:
                    used = self._fds_open(soft)
                    if used + FD_HEADROOM > soft:
                        return f"{used} of {soft} file descriptors open"
            elif res is Resource.MEMORY:
                avail = _mem_available()
                if avail is not None and avail < MIN_MEM_AVAILABLE:
                    return f"{avail // MiB} MiB of memory available"
        except OSError as exc:
            found = classify(exc)
            if found is res:
                return f"probing failed: {exc}"
        return None

    def _fds_open(self, soft: int) -> int:
        """Open fds of this process. Listing /proc/self/fd costs ~0.6 us per fd (1.8 ms
        at 3,000), too much for every create: a count far from the limit is reused for
        a second, one near it is taken again each time."""
        now = time.monotonic()
        if now - self._fds_at < 1.0 and self._fds_used * 2 < soft:
            return self._fds_used
        self._fds_used = len(os.listdir("/proc/self/fd"))
        self._fds_at = now
        return self._fds_used

    def conditions(self) -> list[Condition]:
        """What is exhausted now: noted conditions a probe no longer confirms are
        forgotten (logged once), and probes find what nobody noted yet."""
        with self._lock:
            noted = dict(self._now)
        out: list[Condition] = []
        for res in Resource:
            detail = self._probe(res) if res is not Resource.PIDS else None
            if res in self._probes and detail is None:
                self._clear(res)  # a watched probe reports its owner's state: no lag
                continue
            cond = noted.get(res)
            if detail is not None:
                out.append(cond or self._remember(res, detail))
                continue
            if cond is None:
                continue
            probed = res is not Resource.PIDS
            quiet = time.monotonic() - cond.last > (2.0 if probed else QUIET_CLEARS)
            if quiet:
                self._clear(res)
            else:
                out.append(cond)
        return out

    def _remember(self, res: Resource, detail: str) -> Condition:
        self.note(res, detail)
        with self._lock:
            return self._now[res]

    def _clear(self, res: Resource) -> None:
        with self._lock:
            cond = self._now.pop(res, None)
        if cond is not None:
            log.warning(
                "%s available again after %.1fs", res.value, max(0.0, time.time() - cond.since)
            )


_current: Exhaustion | None = None


def register(ex: Exhaustion) -> None:
    """Make ``ex`` the process's tracker (the edge's), for :func:`typed_anywhere`."""
    global _current
    _current = ex


def typed_anywhere(exc: BaseException) -> DSecError | None:
    """The typed error for an exhaustion that escaped every other handler (the HTTP
    layer's last resort), noted in the edge's tracker so that health shows it too."""
    if _current is not None:
        return _current.typed(exc)
    res = classify(exc)
    return None if res is None else Exhaustion.error(res, f"{type(exc).__name__}: {exc}")


def _mem_available() -> int | None:
    with open("/proc/meminfo", "rb") as fh:
        for line in fh:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None
