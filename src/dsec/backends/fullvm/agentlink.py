"""DSec's own agent in a full VM, when its image has one: the link and the probe.

Why a probe and not a flag in the image: a full VM runs any OS, and only the guest
knows whether ``dsec-init`` serves its ``dsec.agent`` port (debian-desktop starts it
as a systemd service, dsec.guest.desktopimage; the busybox test image has none). So
every VM gets the port, and after qemu-ga answers the backend asks QEMU whether a guest
program holds the port open (QMP ``query-chardev``: no wait at all for an image
without the agent, whose port nobody opens), then links the channel and waits briefly
for the guest's HELLO READY and a ping: an answer makes the sandbox
declare sessions (PTY, streaming, the agent's file operations), silence keeps the typed
``Unsupported``; a guest that opens the port later (its agent service started late,
or came back after a relink gave up) is seen by the watcher and linked then
(``look_again``). Everything on the channel is the guest's and untrusted: the host end is
the microVM's (dsec.guest.channel.GuestChannel, fed through ``socket_path_nofollow``
because the chardev's directory is QEMU's), and the data path is AgentClient's.

The edge's socket (``agent.sock`` in the root-only VM directory) stays bound across
pause and resume like a microVM's (dsec.backends.microvm.machine): requests that arrive
while a VM is restored wait in its backlog and are served by the next channel; a probe
that fails after a restore closes it, failing them instead of leaving them hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from pathlib import Path

from dsec.backends.fullvm.machine import AGENT_CHARDEV
from dsec.backends.microvm.machine import bind_agent_socket
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.errors import BackendError
from dsec.guest.channel import GuestChannel
from dsec.sessions.agent_client import AgentClient

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 5.0  # seconds an image with the agent has to answer once qemu-ga does
OPEN_WAIT = 3.0  # seconds a restored VM's port takes to show as open again
RELINK_WAIT = 15.0  # seconds a guest's restarted agent service has to open the port
LOOK_EVERY = 10.0  # seconds between looks at the port of a VM whose agent is not linked
LOOK_MAX = 600.0  # the longest wait after probes the guest left unanswered


class AgentLink:
    """The agent channel of one full VM in this edge process."""

    def __init__(
        self, chardev: Path, listen: Path, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.chardev = chardev  # QEMU's -chardev socket (in its own directory)
        self.listen = listen  # the edge's socket AgentClient connects to
        self.ready = False  # the guest's agent answered the last probe
        self.parked = False  # channel dropped on purpose (QEMU saved to a file): no relink
        self._listener: socket.socket | None = None
        self._channel: GuestChannel | None = None
        self._clock = clock  # of look_again's waits
        self._next_look = math.inf  # of look_again: none before a probe ended
        self._look_wait = LOOK_EVERY  # doubles after each probe left unanswered

    async def _guest_opened(self, qmp: Qmp, wait: float) -> bool:
        deadline = time.monotonic() + wait
        while True:
            try:
                if await qmp.guest_opened(AGENT_CHARDEV):
                    return True
            except QmpError as exc:
                log.debug("agent channel %s: no chardev state: %s", self.chardev, exc)
                return False
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    async def check(self, qmp: Qmp) -> None:
        """Drop the channel of a ready agent whose guest end closed its port (its mux
        or agent ended and the service restarts them: the new mux waits for a RESET
        that only a new channel sends) or took no request in time (a stopped mux),
        so ``needs_relink`` turns true."""
        if not self.ready or self._channel is None or self._channel.lost is not None:
            return
        try:
            opened = await qmp.guest_opened(AGENT_CHARDEV)
        except QmpError:
            return  # QEMU busy or gone: the guest-end watcher's business
        if not opened:
            log.warning("agent channel %s: the guest closed its port", self.chardev)
            await self.drop()
        elif (why := self._channel.stalled()) is not None:
            # The port stays open and quiet (a stopped mux): requests fail now, and
            # the relink's probe decides whether the agent is still there.
            log.warning("agent channel %s: %s", self.chardev, why)
            await self.drop()

    def restart_waits(self) -> None:
        """The VM was held (paused, restored, snapshotted): requests sent meanwhile
        get the whole stall window from now (GuestChannel.restart_waits)."""
        if self._channel is not None:
            self._channel.restart_waits()

    async def look_again(self, qmp: Qmp) -> bool:
        """For a link whose agent is not linked (none answered at boot, or a relink
        gave up): whether the guest holds the port open now, so a probe is due. An
        agent service that started late, or came back after the relink's wait, gets
        its sessions (back) this way instead of never. Looked at every LOOK_EVERY; after
        a probe found the port open and got no answer the wait doubles up to LOOK_MAX,
        so a guest that holds the port and never answers costs one short probe now
        and then, and an image without the agent one QMP query per LOOK_EVERY."""
        if self.ready or self.parked or self._clock() < self._next_look:
            return False
        self._next_look = self._clock() + self._look_wait
        try:
            return await qmp.guest_opened(AGENT_CHARDEV)
        except QmpError:
            return False

    def needs_relink(self) -> bool:
        """True when a ready agent has no live channel (the guest broke it: a protocol
        violation, its mux died; or a pause that failed dropped it)."""
        if not self.ready or self.parked:
            return False
        return self._channel is None or self._channel.lost is not None

    async def probe(self, qmp: Qmp, *, open_wait: float = 0.0) -> bool:
        """Link a new channel and wait for the agent; ``ready`` says the outcome.
        ``open_wait``: how long the port may take to show as open (a VM just loaded
        from a saved state gets its port state back from QEMU only shortly after the
        load, a timer; a restarted agent service needs a moment)."""
        self._next_look = math.inf  # the watcher does not look while this runs
        try:
            return await self._link(qmp, open_wait)
        finally:
            self._next_look = self._clock() + self._look_wait

    async def _link(self, qmp: Qmp, open_wait: float) -> bool:
        await self.drop()
        self.parked = False
        timeout = PROBE_TIMEOUT
        if not await self._guest_opened(qmp, open_wait):
            await self.close()
            return False
        if self._listener is None:
            self._listener = bind_agent_socket(self.listen)
        channel = GuestChannel(
            self.chardev, self.listen, sock=self._listener, connect_timeout=timeout
        )
        try:
            await channel.start()
            self._channel = channel
            await channel.wait_ready(timeout)
            await AgentClient(self.listen).ping(timeout=timeout)
        except BackendError as exc:
            log.warning(
                "agent channel %s: the guest's agent does not answer: %s", self.chardev, exc
            )
            await self.close()
            self._look_wait = min(self._look_wait * 2, LOOK_MAX)  # port open, no answer
            return False
        self.ready = True
        self._look_wait = LOOK_EVERY
        return True

    async def park(self) -> None:
        """Drop the channel until the next probe (a pause ends QEMU: the next one
        comes with the restore), keeping ``ready`` and the edge's socket."""
        self.parked = True
        await self.drop()

    async def drop(self) -> None:
        """End the channel (QEMU is about to end, or a new one follows); the edge's
        socket stays, so requests wait for the next channel."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def close(self) -> None:
        """End the channel and the edge's socket: waiting requests fail (typed)."""
        await self.drop()
        self.ready = False
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.listen.unlink()
