"""The edge's death watch of a passively watched init (dsec.edge.deaths): no fd until
the backend's connection to the init ends, then a report if the init is gone and a
pidfd if it is not (a pid 1 that closed its connection is watched all the same)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from dsec.api.events import AuditKind, EventKind, Severity
from dsec.backends.container.initwatch import InitChannels
from dsec.edge.deaths import InitWatcher
from dsec.security.init_signals import InitSignalWatcher
from tests.waiting import until_async


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


async def test_closed_while_alive_falls_back_to_a_pidfd() -> None:
    deaths: list[tuple[str, int, int | None]] = []
    watcher = InitWatcher(lambda sid, pid, st: deaths.append((sid, pid, st)))
    proc = _sleeper()
    try:
        assert watcher.watch("sb", proc.pid, passive=True)
        assert (watcher.watched, watcher.pidfds) == (1, 0)  # no fd spent
        watcher.closed("sb")  # the connection ended, the init did not
        assert (watcher.watched, watcher.pidfds) == (1, 1)
        assert deaths == []
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        await until_async("the death seen", lambda: deaths, 5.0, interval=0.01)
        assert deaths[0][:2] == ("sb", proc.pid)
    finally:
        proc.kill()
        proc.wait()
        await watcher.close()


async def test_closed_after_death_reports_it() -> None:
    deaths: list[tuple[str, int, int | None]] = []
    watcher = InitWatcher(lambda sid, pid, st: deaths.append((sid, pid, st)))
    proc = _sleeper()
    try:
        assert watcher.watch("sb", proc.pid, passive=True)
        proc.kill()
        proc.wait()  # reaped by us, not by a reaper it knows: status unknown
        watcher.closed("sb")
        await until_async("the death seen", lambda: deaths, 5.0, interval=0.01)
        assert deaths == [("sb", proc.pid, None)]
        assert watcher.watched == 0
        watcher.closed("sb")  # a second end changes nothing
        watcher.forget("sb")
    finally:
        await watcher.close()


class _NoAudit:
    """An AuditSink nothing is written to here (no report arrives in this test)."""

    def record(self, sandbox_id: str, kind: AuditKind, action: str, **detail: Any) -> None:
        raise AssertionError("nothing to record")

    def event(
        self, sandbox_id: str, kind: EventKind, *, severity: Severity | None = None, **detail: Any
    ) -> None:
        raise AssertionError("nothing to record")


def test_notify_fd_hangup_is_the_containers_death_watch(tmp_path: Path) -> None:
    """dsec.backends.container.initwatch: a container under the notify filter is watched
    through its notify fd (no fd of its own); a hang-up before the edge watched makes
    the edge take a pidfd instead, so no death goes unnoticed either way."""
    channels = InitChannels(InitSignalWatcher(_NoAudit()), lambda sid: tmp_path / sid / "a.sock")
    ended: list[str] = []
    channels.started("a", notify=True)
    assert channels.watch_init("a", ended.append)  # passive: no pidfd
    channels.ended("a")
    assert ended == ["a"]
    channels.started("b", notify=True)
    channels.ended("b")  # it died before the edge watched
    assert not channels.watch_init("b", ended.append)  # the edge takes a pidfd
    assert ended == ["a"]
    channels.ended("zzz")  # a verifier's filter under an unknown id: nothing
    channels.started("c", notify=True)
    channels.detached("c")  # the listener stopped: the lasting connection takes over
    assert channels.by_notify == 2
    for sid in ("a", "b", "c"):
        channels.forget(sid)
    assert channels.by_notify == 0
