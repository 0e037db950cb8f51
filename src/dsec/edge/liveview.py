"""The live view of a sandbox's screen: its VNC server relayed over a WebSocket.

Why a relay and not a VNC proxy: QEMU's VNC server listens on a unix socket in the VM's
own socket directory (dsec.backends.fullvm.machine.VNC_SOCKET), which only the edge
(root) can open, so it needs no password and no TCP port exists. The edge passes the
bytes both ways unchanged: the guest controls what its display shows and so what the
VNC server sends, and nothing here parses it (the browser's noVNC draws it into a
canvas, never as markup). The client side is authorized before this module is reached
(the sandbox's data-path token or an API key, dsec.apiserver.datapath).

Bounds: at most ``MAX_VIEWERS`` relays per sandbox (each costs QEMU an encoder and a
framebuffer copy); reads are ``CHUNK`` bytes and each is handed on before the next is
read, in both directions (the socket's ``drain``, the WebSocket's own send), so a slow
viewer slows QEMU's updates instead of growing a buffer here. A closed socket on
either side ends the other. Opening a view is a request to the sandbox (it resets its
idle TTL, and resumes a paused one); what flows afterwards does not count as activity,
since a viewer keeps asking for updates while it merely watches, and a forgotten tab
should not keep a VM alive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dsec.api.events import AuditKind
from dsec.backends.base import Capability
from dsec.edge.edge import Edge
from dsec.errors import BackendError, TooManyViewers
from dsec.linux import socket_path_nofollow

MAX_VIEWERS = 4
CHUNK = 64 << 10
CONNECT_TIMEOUT = 5.0

Receive = Callable[[], Awaitable[bytes | None]]  # None: the viewer went away
Send = Callable[[bytes], Awaitable[None]]


@dataclass
class Link:
    """One open connection to a sandbox's VNC server, counted against its viewers."""

    sandbox_id: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class LiveViews:
    """The open live views of one edge, at most ``max_viewers`` per sandbox."""

    def __init__(self, edge: Edge, *, max_viewers: int = MAX_VIEWERS) -> None:
        self.edge = edge
        self.max_viewers = max_viewers
        self._open: Counter[str] = Counter()

    def viewers(self, sandbox_id: str) -> int:
        return self._open[sandbox_id]

    async def open(self, sandbox_id: str) -> Link:
        """Connect to the running sandbox's VNC server (501 for a backend without a
        display, 429 ``too_many_viewers`` past the bound, 500 if it does not answer)."""
        rec = self.edge.running_record(sandbox_id)
        backend = self.edge.backend_of(rec, Capability.COMPUTER_USE)
        if self._open[sandbox_id] >= self.max_viewers:
            raise TooManyViewers(
                f"sandbox {sandbox_id} already has {self.max_viewers} live viewers",
                limit=self.max_viewers,
            )
        self._open[sandbox_id] += 1  # counted before the await: no race past the bound
        try:
            path = await self.edge.call_running(sandbox_id, backend.desktop_socket)
            try:
                with socket_path_nofollow(path) as safe:  # QEMU can write its directory
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_unix_connection(safe, limit=CHUNK), CONNECT_TIMEOUT
                    )
            except (OSError, TimeoutError) as exc:
                raise BackendError(
                    f"the live view of {sandbox_id} does not answer: {exc}"
                ) from None
        except BaseException:
            self._release(sandbox_id)
            raise
        self.edge.audit.record(sandbox_id, AuditKind.COMMAND, "live_view_opened")
        return Link(sandbox_id, reader, writer)

    def release(self, link: Link) -> None:
        """Give back a link that will not be relayed (the upgrade failed)."""
        link.writer.close()
        self._release(link.sandbox_id)

    def _release(self, sandbox_id: str) -> None:
        self._open[sandbox_id] -= 1
        if self._open[sandbox_id] <= 0:
            del self._open[sandbox_id]

    async def relay(self, link: Link, receive: Receive, send: Send) -> None:
        """Pass bytes both ways until either side closes; then close both."""

        async def to_vm() -> None:
            while (data := await receive()) is not None:
                link.writer.write(data)
                await link.writer.drain()

        async def to_viewer() -> None:
            while data := await link.reader.read(CHUNK):
                await send(data)

        tasks = [asyncio.create_task(to_vm()), asyncio.create_task(to_viewer())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            link.writer.close()
            with contextlib.suppress(Exception):
                await link.writer.wait_closed()
            self._release(link.sandbox_id)
            self.edge.audit.record(link.sandbox_id, AuditKind.COMMAND, "live_view_closed")
