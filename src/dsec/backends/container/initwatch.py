"""How the edge learns of a container's pid 1, holding one fd per sandbox for it.

A container started under the notify filter already costs the edge its seccomp notify
fd, and that fd also says when the sandbox ended (EPOLLHUP once every task using the
filter exited) and when pid 1 wants to report signals (its doorbell); see
dsec.security.seccomp_listener. So such a sandbox gets no other fd: its death watch is
the notify fd and its signal reports come over short drains
(dsec.security.init_signals). Every other container (an adopted one, whose notify fd
died with the edge before; a verifier; a host without the notify listener) keeps the
lasting signal-report connection, which is its death watch as before. If the listener
stops (its fds closed without a hang-up), its sandboxes fall back to that connection.

This object is the listener's observer (``ListenerObserver``); it runs on the event
loop, told by the listener thread through ``call_soon_threadsafe``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dsec.security.init_signals import InitSignalWatcher


class InitChannels:
    """Which channel watches each container's pid 1, and the listener's events."""

    def __init__(self, signals: InitSignalWatcher, socket_of: Callable[[str], Path]) -> None:
        self.signals = signals
        self.socket_of = socket_of
        self._on_closed: Callable[[str], None] = lambda sandbox_id: None
        self._by_notify: set[str] = set()  # pid 1 watched through the notify fd
        self._watched: set[str] = set()  # ... and the edge's death watch relies on it
        self._ended: set[str] = set()  # its notify fd hung up before the edge watched

    def started(self, sandbox_id: str, *, notify: bool) -> None:
        """A container just started: ``notify`` if its notify fd is (being) received
        by a live listener, else it gets the lasting connection."""
        if notify:
            self._by_notify.add(sandbox_id)
        else:
            self.signals.watch(sandbox_id, self.socket_of(sandbox_id))

    def adopted(self, sandbox_id: str) -> None:
        """A container this edge did not start: no notify fd, the lasting connection
        (which also hands over what pid 1 kept meanwhile)."""
        self.signals.watch(sandbox_id, self.socket_of(sandbox_id))

    def watch_init(self, sandbox_id: str, on_closed: Callable[[str], None]) -> bool:
        """The edge's death watch asks: True if a channel of ours will call
        ``on_closed(sandbox_id)`` when pid 1 may have ended (dsec.edge.deaths)."""
        self._on_closed = on_closed
        self.signals.on_closed = on_closed
        if self.signals.watching(sandbox_id):
            return True
        if sandbox_id in self._by_notify and sandbox_id not in self._ended:
            self._watched.add(sandbox_id)
            return True
        return False

    def forget(self, sandbox_id: str) -> None:
        """The container is being torn down: nothing of it is watched any more."""
        self.signals.unwatch(sandbox_id)
        self._by_notify.discard(sandbox_id)
        self._watched.discard(sandbox_id)
        self._ended.discard(sandbox_id)

    @property
    def by_notify(self) -> int:
        """Containers whose pid 1 costs the edge no fd beyond the notify fd."""
        return len(self._by_notify)

    # -- ListenerObserver (dsec.security.seccomp_listener) ------------------------------
    def ended(self, sandbox_id: str) -> None:
        if sandbox_id not in self._by_notify:
            return
        if sandbox_id in self._watched:
            self._watched.discard(sandbox_id)
            self._on_closed(sandbox_id)
        else:
            self._ended.add(sandbox_id)  # before the edge watched: watch_init says so

    def doorbell(self, sandbox_id: str) -> None:
        if sandbox_id in self._by_notify:
            self.signals.drain(sandbox_id, self.socket_of(sandbox_id))

    def detached(self, sandbox_id: str) -> None:
        if sandbox_id in self._by_notify and sandbox_id not in self._ended:
            self._by_notify.discard(sandbox_id)
            self._watched.discard(sandbox_id)
            self.signals.watch(sandbox_id, self.socket_of(sandbox_id))
