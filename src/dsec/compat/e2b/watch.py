"""E2B's directory watchers, by comparing listings made through our files interface.

Our in-sandbox agent has no inotify, so a watcher keeps the last listing of its
directory and reports what differs from the next one: new entries as creates, gone
ones as removes, a changed size or mtime as a write (a rename shows as remove +
create, and a change undone between two looks is not seen). The polled watcher of the
sync SDK (CreateWatcher / GetWatcherEvents) looks when asked; the streamed one of the
async SDK (WatchDir) looks every POLL seconds. Watchers live in this apiserver's memory
(at most MAX_WATCHERS; the oldest goes first) and are bound to their sandbox.
"""

from __future__ import annotations

import posixpath
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.api.files import FileInfo
from dsec.edge.dataplane import DataPlane
from dsec.errors import NotFound

POLL = 0.5
MAX_WATCHERS = 4096

Snapshot = dict[str, FileInfo]


@dataclass
class Watcher:
    sandbox_id: str
    path: str
    recursive: bool
    include_entry: bool
    seen: Snapshot = field(default_factory=dict)


async def snapshot(plane: DataPlane, w: Watcher) -> Snapshot:
    listing = await plane.list_dir(w.sandbox_id, w.path, recursive=w.recursive)
    return {info.path.lstrip("/"): info for info in listing.entries}


def diff(
    before: Snapshot, after: Snapshot, w: Watcher, entry: Callable[[FileInfo, str], dict[str, Any]]
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def event(name: str, kind: str, info: FileInfo | None) -> None:
        out: dict[str, Any] = {"name": name, "type": kind}
        if w.include_entry and info is not None:
            out["entry"] = entry(info, posixpath.join(w.path, name))
        events.append(out)

    for name, info in after.items():
        old = before.get(name)
        if old is None:
            event(name, "EVENT_TYPE_CREATE", info)
        elif (old.size, old.mtime, old.type) != (info.size, info.mtime, info.type):
            event(name, "EVENT_TYPE_WRITE", info)
    for name, info in before.items():
        if name not in after:
            event(name, "EVENT_TYPE_REMOVE", info)
    return events


class Watchers:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self._all: OrderedDict[str, Watcher] = OrderedDict()

    async def create(self, w: Watcher) -> str:
        w.seen = await snapshot(self.plane, w)
        wid = secrets.token_hex(12)
        self._all[wid] = w
        while len(self._all) > MAX_WATCHERS:
            self._all.popitem(last=False)
        return wid

    def get(self, sandbox_id: str, wid: str) -> Watcher:
        w = self._all.get(wid)
        if w is None or w.sandbox_id != sandbox_id:
            raise NotFound(f"watcher {wid[:64]!r} not found")
        return w

    def remove(self, sandbox_id: str, wid: str) -> None:
        self.get(sandbox_id, wid)
        del self._all[wid]

    async def changes(
        self, w: Watcher, entry: Callable[[FileInfo, str], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        now = await snapshot(self.plane, w)
        events = diff(w.seen, now, w, entry)
        w.seen = now
        return events
