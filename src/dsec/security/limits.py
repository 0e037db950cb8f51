"""Resource-limit detection: tell the trainer when a sandbox ran into one of its limits.

The kernel enforces the limits (memory and pids cgroups, the disk quota group, the
agent's output cap and timeout); this module only *notices* and raises
``EventKind.RESOURCE_LIMIT`` events, so a trainer can tell "the agent's code is wrong"
from "the agent fork-bombed". Signals, all counters the kernel keeps anyway:

* memory: an OOM kill (v1 ``memory.oom_control`` ``oom_kill``, v2 ``memory.events``);
* pids: a refused fork (``pids.events`` ``max``, v1 and v2);
* disk: quota-group usage at its limit (btrfs sysfs, see ``dsec.resources.disk``);
* output: a command's output was truncated at ``max_output_bytes``; timeout: it was
  killed at its ``timeout``.

Cheap by construction, and flat in the number of sandboxes: a normal command (exit 0,
not truncated, not timed out) costs a dict lookup; counters are read after a command
that ended abnormally, when a sandbox stops, and when the kernel says a sandbox's OOM or
refused-fork counter moved (dsec.resources.cgevents: inotify on ``pids.events`` and v2
``memory.events``, shared eventfds for v1 OOM notifications), which is how what
background processes do is noticed. No scan reads every sandbox every few seconds any
more (at 10,000 sandboxes that was 20,000 file reads every 2 s): a bounded sweep reads
at most ``per_tick`` sandboxes per ``interval``, round robin, the safety net for the
disk quota (btrfs does not notify) and for a sandbox that could not be watched. An event
is raised only when a counter *increased* since it was last seen (disk: when usage
reaches the limit after having been below it), so a sandbox that keeps hitting a limit
raises one event per new hit, not one per scan.

Never in the way: every entry point (``after_exec``, ``check``, an event, the sweep, per
sandbox) runs under a ``DetectorGuard``, so a failure is a ``detector_error`` event and
the command's audit record, its process-end record and the other sandboxes' checks
still happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dsec.api.events import EventKind, Severity
from dsec.exhaustion import classify
from dsec.resources.cgevents import CgroupEvents
from dsec.resources.cgroups import CgroupHost, Layout
from dsec.resources.disk import DiskUsage
from dsec.security.audit import AuditSink
from dsec.security.guard import DetectorGuard

log = logging.getLogger(__name__)

DEFAULT_SCAN_INTERVAL = 2.0
SWEEP_PER_TICK = 32  # sandboxes the safety-net sweep reads per interval, whatever N is
# After a kernel notification: v1 signals an OOM before its kill counts, so look again.
RECHECK_AFTER = (0.05, 0.5)


@dataclass(frozen=True)
class LimitReading:
    """What the kernel says about one sandbox's limits right now."""

    oom_kills: int | None = None
    pids_refused: int | None = None
    disk: DiskUsage | None = None


def _keyed(path: str, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed cgroup file ("key value" lines)."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def read_cgroup_counters(host: CgroupHost, rel: str) -> tuple[int | None, int | None]:
    """(OOM kills, refused forks) of the cgroup ``rel`` on v1, hybrid or v2 hosts."""
    rel = rel.strip("/")
    oom: int | None = None
    pids: int | None = None
    if "memory" in host.v1:
        oom = _keyed(f"{host.v1['memory']}/{rel}/memory.oom_control", "oom_kill")
    elif host.layout is Layout.V2 and host.v2 is not None:
        oom = _keyed(f"{host.v2}/{rel}/memory.events", "oom_kill")
    if "pids" in host.v1:
        pids = _keyed(f"{host.v1['pids']}/{rel}/pids.events", "max")
    elif host.layout is Layout.V2 and host.v2 is not None:
        pids = _keyed(f"{host.v2}/{rel}/pids.events", "max")
    return oom, pids


@dataclass
class _Seen:
    oom_kills: int = 0
    pids_refused: int = 0
    disk_at_limit: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


Probe = Callable[[Any], LimitReading | None]


class LimitWatcher:
    """Raises resource-limit events for the sandboxes of one edge.

    ``probe(rec)`` reads a sandbox's counters (the backend knows where they are);
    ``rec`` is anything with ``.id`` and ``.spec`` (a ``SandboxRecord``).
    ``cgroup_of(rec)`` names the cgroup whose notifications say when to probe (None:
    the sandbox has none, it is read after abnormal commands, at its end and by the
    sweep); ``host`` is the cgroup layout (None: no notifications at all).
    """

    def __init__(
        self,
        audit: AuditSink,
        probe: Probe,
        *,
        interval: float = DEFAULT_SCAN_INTERVAL,
        per_tick: int = SWEEP_PER_TICK,
        host: CgroupHost | None = None,
        cgroup_of: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.audit = audit
        self.probe = probe
        self.interval = interval
        self.per_tick = per_tick
        self.cgroup_of = cgroup_of
        self._seen: dict[str, _Seen] = {}
        # Watched sandboxes, in sweep order: the sweep takes from the front, puts back.
        self._ring: OrderedDict[str, Any] = OrderedDict()
        self._rechecks: dict[str, list[asyncio.TimerHandle]] = {}
        self.events = CgroupEvents(host, self._kernel_event) if host is not None else None
        self._task: asyncio.Task[None] | None = None
        self.guard = DetectorGuard(audit)

    # -- bookkeeping -----------------------------------------------------------------------
    def track(self, sandbox_id: str) -> None:
        """A sandbox this edge just created: its counters start at zero, so a limit hit
        before the first scan is still reported."""
        self._seen[sandbox_id] = _Seen()

    def watch(self, rec: Any) -> None:
        """Notice ``rec``'s limit hits from now on (created, or adopted after a restart):
        its cgroup's notifications, and a place in the sweep."""
        self._ring[rec.id] = rec
        rel = self.cgroup_of(rec) if self.cgroup_of is not None else None
        if self.events is not None and rel is not None:
            self.events.watch(rec.id, rel)

    @property
    def watched(self) -> int:
        return len(self._ring)

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)
        self._ring.pop(sandbox_id, None)
        for handle in self._rechecks.pop(sandbox_id, []):
            handle.cancel()
        if self.events is not None:
            self.events.unwatch(sandbox_id)
        self.guard.forget(sandbox_id)

    def _kernel_event(self, sandbox_id: str) -> None:
        """The kernel says a counter of ``sandbox_id`` may have moved: read it now and
        again shortly (v1 notifies an OOM before the kill is counted)."""
        rec = self._ring.get(sandbox_id)
        if rec is None:
            return
        self.check(rec)
        if self._rechecks.get(sandbox_id):
            return  # looks are already planned: they will see this one too
        loop = asyncio.get_running_loop()
        self._rechecks[sandbox_id] = [
            loop.call_later(delay, self._recheck, sandbox_id, i == len(RECHECK_AFTER) - 1)
            for i, delay in enumerate(RECHECK_AFTER)
        ]

    def _recheck(self, sandbox_id: str, last: bool) -> None:
        if last:
            self._rechecks.pop(sandbox_id, None)
        rec = self._ring.get(sandbox_id)
        if rec is not None:
            self.check(rec)

    # -- hooks -----------------------------------------------------------------------------
    def after_exec(
        self,
        rec: Any,
        *,
        exit_code: int | None,
        timed_out: bool,
        truncated: bool,
        command: object = None,
        max_output_bytes: int | None = None,
        timeout: float | None = None,
        process: str | None = None,
    ) -> None:
        """Call when a command or process ended. Free unless it ended abnormally.
        Never raises (a failure is a ``detector_error`` event)."""
        self.guard.run(
            "limits",
            rec.id,
            lambda: self._after_exec(
                rec, exit_code, timed_out, truncated, command, max_output_bytes, timeout, process
            ),
        )

    def _after_exec(
        self,
        rec: Any,
        exit_code: int | None,
        timed_out: bool,
        truncated: bool,
        command: object,
        max_output_bytes: int | None,
        timeout: float | None,
        process: str | None,
    ) -> None:
        where: dict[str, Any] = {"command": _short(command)} if command is not None else {}
        if process is not None:
            where["process"] = process
        if truncated:
            self._raise(rec.id, "output", value=max_output_bytes, **where)
        if timed_out:
            self._raise(rec.id, "timeout", value=timeout, **where)
        if timed_out or truncated or (exit_code is not None and exit_code != 0):
            # Counters say a limit was hit since the last look, not by whom: name the
            # command as the one after which it was seen.
            self._check(rec, **{f"seen_after_{k}": v for k, v in where.items()})

    def check(self, rec: Any, **where: Any) -> None:
        """Read ``rec``'s counters and raise an event for each one that went up.
        Never raises (a failure is a ``detector_error`` event)."""
        self.guard.run("limits", rec.id, lambda: self._check(rec, **where))

    def _check(self, rec: Any, **where: Any) -> None:
        try:
            reading = self.probe(rec)
        except Exception:  # a sandbox that is going away: nothing to learn
            log.debug("limit probe of %s failed", rec.id, exc_info=True)
            return
        if reading is None:
            return
        seen = self._seen.get(rec.id)
        if seen is None:  # re-adopted after a restart: what it did before is old news
            self._seen[rec.id] = _Seen(
                reading.oom_kills or 0,
                reading.pids_refused or 0,
                bool(reading.disk and reading.disk.at_limit),
            )
            return
        spec = rec.spec
        with seen.lock:
            raised: list[tuple[str, dict[str, Any]]] = []
            if reading.oom_kills is not None and reading.oom_kills > seen.oom_kills:
                raised.append(
                    (
                        "memory",
                        {
                            "value": spec.memory_limit_mb,
                            "unit": "MiB",
                            "oom_kills": reading.oom_kills - seen.oom_kills,
                        },
                    )
                )
                seen.oom_kills = reading.oom_kills
            if reading.pids_refused is not None and reading.pids_refused > seen.pids_refused:
                raised.append(
                    (
                        "pids",
                        {
                            "value": spec.pids_limit,
                            "refused_forks": reading.pids_refused - seen.pids_refused,
                        },
                    )
                )
                seen.pids_refused = reading.pids_refused
            if reading.disk is not None:
                hit = reading.disk.at_limit
                if hit and not seen.disk_at_limit:
                    raised.append(
                        (
                            "disk",
                            {
                                "value": reading.disk.limit,
                                "unit": "bytes",
                                "used": reading.disk.used,
                            },
                        )
                    )
                seen.disk_at_limit = hit
        for limit, detail in raised:
            self._raise(rec.id, limit, **detail, **where)

    def _raise(self, sandbox_id: str, limit: str, **detail: Any) -> None:
        self.audit.event(
            sandbox_id,
            EventKind.RESOURCE_LIMIT,
            severity=Severity.WARNING if limit in ("memory", "pids", "disk") else Severity.INFO,
            limit=limit,
            **detail,
        )

    # -- notifications and the bounded sweep ---------------------------------------------
    def start(self) -> None:
        """Listen for the kernel's notifications and run the sweep: every ``interval``,
        the next ``per_tick`` watched sandboxes are read (in a worker thread), so its cost
        does not grow with the number of sandboxes."""
        if self.events is not None:
            self.events.start()
        if self._task is None and self.interval > 0 and self.per_tick > 0:
            self._task = asyncio.create_task(self._loop(), name="dsec-limit-sweep")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handles in self._rechecks.values():
            for handle in handles:
                handle.cancel()
        self._rechecks.clear()
        if self.events is not None:
            self.events.close()

    def next_batch(self) -> list[Any]:
        """The next ``per_tick`` sandboxes of the sweep, moved to the back (O(per_tick))."""
        batch = []
        for _ in range(min(self.per_tick, len(self._ring))):
            sid, rec = self._ring.popitem(last=False)
            self._ring[sid] = rec
            batch.append(rec)
        return batch

    async def _loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.to_thread(self.scan, self.next_batch())
            except Exception as exc:
                # Once per streak (every interval otherwise); exhaustion without traceback.
                if not failing:
                    if classify(exc) is not None:
                        log.warning("resource-limit sweep failed: %s", exc)
                    else:
                        log.exception("resource-limit sweep failed")
                failing = True
            else:
                failing = False

    def scan(self, recs: Iterable[Any]) -> None:
        for rec in recs:
            self.check(rec)  # guarded per sandbox: one failure does not skip the rest


def _short(command: object, limit: int = 256) -> object:
    if isinstance(command, str):
        return command if len(command) <= limit else command[:limit] + "..."
    if isinstance(command, list):
        text = " ".join(str(a) for a in command)
        return text if len(text) <= limit else text[:limit] + "..."
    return command
