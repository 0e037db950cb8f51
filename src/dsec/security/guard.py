"""Run detectors so that one that raises can never stop the audit stream.

A detector looks at state the sandbox controls, so it must expect to be crashed (a
tree too deep, a name it did not foresee, a file that vanishes under it). Whatever it
raises, the hook that called it goes on: the command's audit record, the other
detectors, process-end records. The failure is on record as a ``detector_error``
event every time it happens (each one is a command whose check did not run), and in
the edge's log once per detector and sandbox (not per command: a sandbox that
crashes a detector on every command must not flood the log).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TypeVar

from dsec.api.events import EventKind, Severity
from dsec.security.audit import AuditSink
from dsec.security.safe_text import lines

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LOGGED = 10_000  # (detector, sandbox) pairs remembered as already logged


class DetectorGuard:
    """``guard.run("tamper", sandbox_id, fn)``: ``fn()``, or ``None`` if it raised."""

    def __init__(self, audit: AuditSink) -> None:
        self.audit = audit
        self._logged: set[tuple[str, str]] = set()

    def run(
        self,
        detector: str,
        sandbox_id: str,
        fn: Callable[[], T],
        *,
        severity: Severity | None = None,
    ) -> T | None:
        try:
            return fn()
        except Exception as exc:
            self._failed(detector, sandbox_id, exc, severity)
            return None

    def _failed(
        self, detector: str, sandbox_id: str, exc: Exception, severity: Severity | None
    ) -> None:
        key = (detector, sandbox_id)
        if key not in self._logged:
            if len(self._logged) >= MAX_LOGGED:
                self._logged.clear()
            self._logged.add(key)
            # The traceback quotes what the sandbox controls (a file name): made inert.
            trace = lines("".join(traceback.format_exception(exc)).rstrip("\n"))
            log.error(
                "detector %s failed for sandbox %s (logged once; every failure is a "
                "detector_error event):\n%s",
                detector,
                sandbox_id,
                trace,
            )
        try:
            self.audit.event(
                sandbox_id,
                EventKind.DETECTOR_ERROR,
                severity=severity,
                detector=detector,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
        except Exception:  # the audit log itself failing: nothing more to do here
            log.debug("recording a detector_error failed", exc_info=True)

    def forget(self, sandbox_id: str) -> None:
        self._logged = {k for k in self._logged if k[1] != sandbox_id}
