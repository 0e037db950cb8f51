"""The edge's death watch of a passively watched init (dsec.edge.deaths): no fd until
the backend's connection to the init ends, then a report if the init is gone and a
pidfd if it is not (a pid 1 that closed its connection is watched all the same)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable

from dsec.edge.deaths import InitWatcher


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


async def _until(cond: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


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
        await _until(lambda: deaths)
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
        await _until(lambda: deaths, timeout=5.0)
        assert deaths == [("sb", proc.pid, None)]
        assert watcher.watched == 0
        watcher.closed("sb")  # a second end changes nothing
        watcher.forget("sb")
    finally:
        await watcher.close()
