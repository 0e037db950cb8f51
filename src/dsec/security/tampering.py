"""Detect changes to a sandbox's system binaries and libraries.

Everything a sandbox changes lands in its overlay upper directory on the host, so
tampering is visible from outside without trusting anything inside: after each
command the edge looks at the few system directories in the upper dir (a handful of
``stat`` calls when nothing changed) and reports paths it has not reported before.
Installing packages with apt also touches these paths; the event is a warning for the
trainer to judge, not a verdict. ``/usr/local`` (pip, npm) is not watched.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

WATCHED = (
    "bin",
    "sbin",
    "lib",
    "lib32",
    "lib64",
    "usr/bin",
    "usr/sbin",
    "usr/lib",
    "usr/lib64",
    "usr/libexec",
    "etc/ld.so.preload",
    "etc/ld.so.conf",
    "etc/ld.so.conf.d",
    "etc/passwd",
    "etc/shadow",
    "etc/sudoers",
)
MAX_SCAN = 2000  # entries per pass: a huge install must not stall the edge
MAX_REPORTED = 50  # paths listed in one event


def _walk(root: Path, rel: str, budget: list[int]) -> Iterator[tuple[str, str]]:
    """(path in the sandbox, change) for entries under ``root/rel``."""
    path = root / rel
    try:
        st = os.lstat(path)
    except OSError:
        return
    if budget[0] <= 0:
        return
    budget[0] -= 1
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        yield "/" + rel, "deleted"  # an overlay whiteout
        return
    if not stat.S_ISDIR(st.st_mode):
        yield "/" + rel, "written"
        return
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return
    for name in names:
        yield from _walk(root, f"{rel}/{name}", budget)


class TamperWatch:
    """Per-sandbox memory of what was already reported, so each change is one event."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def scan(self, sandbox_id: str, upper: Path) -> list[tuple[str, str]]:
        """New changes under the watched system paths since the last scan."""
        seen = self._seen.setdefault(sandbox_id, set())
        budget = [MAX_SCAN]
        found = []
        for rel in WATCHED:
            if not os.path.lexists(upper / rel):
                continue
            for path, change in _walk(upper, rel, budget):
                if path not in seen:
                    seen.add(path)
                    found.append((path, change))
        return found

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)
