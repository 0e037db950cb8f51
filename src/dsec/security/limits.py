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

Cheap by construction: a normal command (exit 0, not truncated, not timed out) costs a
dict lookup; counters are read after a command that ended abnormally, when a sandbox
stops, and by a periodic scan (in a thread) for what background processes do. An event
is raised only when a counter *increased* since it was last seen (disk: when usage
reaches the limit after having been below it), so a sandbox that keeps hitting a limit
raises one event per new hit, not one per scan.

Never in the way: every entry point (``after_exec``, ``check``, the periodic scan, per
sandbox) runs under a ``DetectorGuard``, so a failure is a ``detector_error`` event and
the command's audit record, its process-end record and the other sandboxes' checks
still happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dsec.api.events import EventKind, Severity
from dsec.exhaustion import classify
from dsec.resources.cgroups import CgroupHost, Layout
from dsec.resources.disk import DiskUsage
from dsec.security.audit import AuditSink
from dsec.security.guard import DetectorGuard

log = logging.getLogger(__name__)

DEFAULT_SCAN_INTERVAL = 2.0


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
    """

    def __init__(
        self,
        audit: AuditSink,
        probe: Probe,
        *,
        interval: float = DEFAULT_SCAN_INTERVAL,
    ) -> None:
        self.audit = audit
        self.probe = probe
        self.interval = interval
        self._seen: dict[str, _Seen] = {}
        self._task: asyncio.Task[None] | None = None
        self.guard = DetectorGuard(audit)

    # -- bookkeeping -----------------------------------------------------------------------
    def track(self, sandbox_id: str) -> None:
        """A sandbox this edge just created: its counters start at zero, so a limit hit
        before the first scan is still reported."""
        self._seen[sandbox_id] = _Seen()

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)
        self.guard.forget(sandbox_id)

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

    # -- periodic scan ---------------------------------------------------------------------
    def start(self, running: Callable[[], Iterable[Any]]) -> None:
        """Scan ``running()`` sandboxes every ``interval`` seconds (in a worker thread:
        a thousand sandboxes are a few thousand small file reads)."""
        if self._task is None and self.interval > 0:
            self._task = asyncio.create_task(self._loop(running), name="dsec-limit-scan")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, running: Callable[[], Iterable[Any]]) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.to_thread(self.scan, list(running()))
            except Exception as exc:
                # Once per streak (every interval otherwise); exhaustion without traceback.
                if not failing:
                    if classify(exc) is not None:
                        log.warning("resource-limit scan failed: %s", exc)
                    else:
                        log.exception("resource-limit scan failed")
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
