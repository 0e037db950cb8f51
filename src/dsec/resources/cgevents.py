"""Kernel notifications that a sandbox's limit counters may have moved, so nobody has
to poll every sandbox's counters every few seconds (issue 19: flat in N).

The resource-limit detector (dsec.security.limits) used to read each running sandbox's
``memory.oom_control`` / ``pids.events`` every 2 s: at 10,000 sandboxes that is 20,000
file reads every 2 s, for events that almost never happen. The kernel tells us instead:

* v2 ``pids.events`` and ``memory.events`` are cgroup files the kernel notifies on
  change (``cgroup_file_notify``): one inotify watch each, all on one inotify fd, a
  watch descriptor names the sandbox (O(1) per event). The v1 ``pids.events`` is not
  notified (measured on 6.18: no inotify event for a refused fork), so on v1 hosts a
  refused fork of a background process is found by the limit watcher's bounded sweep
  (or after the next abnormal command, or at the end);
* v1 memory has no notifying file: its OOM notification is an eventfd registered via
  ``cgroup.event_control`` with ``memory.oom_control``. One eventfd per sandbox would
  double the fds a sandbox costs, so sandboxes share eventfds in buckets of
  ``BUCKET``: an event names a bucket, and its few sandboxes are looked at. The kernel
  also signals a registration's eventfd once when its cgroup is removed (a teardown):
  a look at a bucket, nothing more.

The callback only says "look at this sandbox"; what changed is read from the counters
as before, and an event is raised only for a counter that went up, so a spurious or
shared wake-up costs a few file reads and raises nothing. A sandbox that could not be
watched (inotify watches or fds ran out) is reported by ``unwatched`` and still has its
counters read after every abnormal command and at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from inotify_simple import INotify, flags

from dsec.resources.cgroups import CgroupHost, Layout

log = logging.getLogger(__name__)

BUCKET = 16  # sandboxes per shared v1 OOM eventfd: a wake-up reads at most this many


@dataclass
class _Bucket:
    fd: int
    keys: set[str] = field(default_factory=set)


@dataclass
class _Watch:
    wds: list[int] = field(default_factory=list)
    bucket: _Bucket | None = None


class CgroupEvents:
    """``on_event(key)`` when a watched cgroup's OOM or refused-fork counters may have
    changed. Runs on the event loop that called :meth:`start`."""

    def __init__(self, host: CgroupHost, on_event: Callable[[str], None], *, bucket: int = BUCKET):
        self.host = host
        self.on_event = on_event
        self.bucket_size = bucket
        self._inotify: INotify | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._by_wd: dict[int, str] = {}
        self._watches: dict[str, _Watch] = {}
        self._open: list[_Bucket] = []  # buckets with a free slot
        self._buckets: dict[int, _Bucket] = {}
        self.unwatched = 0

    def start(self) -> None:
        """Open the inotify fd and listen on the running loop."""
        if self._inotify is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._inotify = INotify(nonblocking=True)
        self._loop.add_reader(self._inotify.fileno(), self._read_inotify)

    @property
    def watched(self) -> int:
        return len(self._watches)

    def watch(self, key: str, rel: str) -> bool:
        """Watch cgroup ``rel`` (relative to the controllers' roots) as ``key``; False if
        any part could not be watched (logged once; the counters are still read at the
        sandbox's abnormal commands and its end)."""
        self.unwatch(key)
        if self._inotify is None:
            return False
        rel = rel.strip("/")
        w = _Watch()
        self._watches[key] = w
        ok = True
        for path in self._notifying_files(rel):
            try:
                wd = self._inotify.add_watch(path, flags.MODIFY)
            except OSError as exc:
                ok = self._failed(key, f"inotify watch on {path}: {exc}")
                continue
            w.wds.append(wd)
            self._by_wd[wd] = key
        if "memory" in self.host.v1:
            try:
                w.bucket = self._oom_eventfd(key, f"{self.host.v1['memory']}/{rel}")
            except OSError as exc:
                ok = self._failed(key, f"memory.oom_control eventfd: {exc}")
        return ok

    def _notifying_files(self, rel: str) -> list[str]:
        """The notifying files of ``rel`` (v2 only: v1's ``pids.events`` is silent)."""
        if self.host.layout is not Layout.V2 or self.host.v2 is None:
            return []
        return [f"{self.host.v2}/{rel}/pids.events", f"{self.host.v2}/{rel}/memory.events"]

    @property
    def notifies_forks(self) -> bool:
        """Whether refused forks are notified here (v2), or only found by a sweep (v1)."""
        return self.host.layout is Layout.V2

    def _oom_eventfd(self, key: str, memcg: str) -> _Bucket:
        """Register a (shared) eventfd for v1 OOM notifications of ``memcg``."""
        bucket = self._open[-1] if self._open else None
        fresh = bucket is None
        if bucket is None:
            bucket = _Bucket(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        try:
            cfd = os.open(f"{memcg}/memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                with open(f"{memcg}/cgroup.event_control", "w", encoding="ascii") as fh:
                    fh.write(f"{bucket.fd} {cfd}")
            finally:
                os.close(cfd)
        except OSError:
            if fresh:
                os.close(bucket.fd)
            raise
        if fresh:
            assert self._loop is not None
            self._buckets[bucket.fd] = bucket
            self._open.append(bucket)
            self._loop.add_reader(bucket.fd, self._read_bucket, bucket)
        bucket.keys.add(key)
        if len(bucket.keys) >= self.bucket_size:
            self._open.remove(bucket)
        return bucket

    def _failed(self, key: str, why: str) -> bool:
        if self.unwatched == 0:
            log.warning(
                "limit events of %s are not watched (%s): its limits are read after its "
                "abnormal commands and at its end",
                key,
                why,
            )
        self.unwatched += 1
        return False

    def unwatch(self, key: str) -> None:
        w = self._watches.pop(key, None)
        if w is None:
            return
        for wd in w.wds:
            self._by_wd.pop(wd, None)
            if self._inotify is not None:
                # The cgroup may be gone already: its watches went with it.
                with contextlib.suppress(OSError):
                    self._inotify.rm_watch(wd)
        b = w.bucket
        if b is not None:
            # The registration stays until the cgroup goes (the kernel drops it then and
            # signals the eventfd once); the slot is free for the next sandbox.
            b.keys.discard(key)
            if not b.keys:
                self._close_bucket(b)
            elif b not in self._open:
                self._open.append(b)

    def _close_bucket(self, b: _Bucket) -> None:
        if b in self._open:
            self._open.remove(b)
        self._buckets.pop(b.fd, None)
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(b.fd)
        os.close(b.fd)  # registrations on cgroups still alive are dropped by the kernel

    def _read_inotify(self) -> None:
        assert self._inotify is not None
        try:
            events = self._inotify.read(timeout=0)
        except OSError as exc:
            log.warning("cgroup inotify read failed: %s", exc)
            return
        keys: set[str] = set()
        overflow = False
        for ev in events:
            if ev.mask & flags.Q_OVERFLOW:
                overflow = True
            key = self._by_wd.get(ev.wd)
            if key is not None:
                keys.add(key)
        if overflow:  # some events were lost: look at everything once
            log.warning("cgroup inotify queue overflow: reading every sandbox's counters")
            keys = set(self._watches)
        for key in keys:
            self._notify(key)

    def _read_bucket(self, b: _Bucket) -> None:
        try:
            os.eventfd_read(b.fd)
        except BlockingIOError:
            return
        for key in list(b.keys):
            self._notify(key)

    def _notify(self, key: str) -> None:
        try:
            self.on_event(key)
        except Exception:
            log.exception("handling a limit event of %s failed", key)

    def close(self) -> None:
        for key in list(self._watches):
            self.unwatch(key)
        for b in list(self._buckets.values()):
            self._close_bucket(b)
        if self._inotify is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None
