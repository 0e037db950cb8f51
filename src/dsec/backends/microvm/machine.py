"""One microVM as the backend runs it: its QEMU, QMP link, agent channel and the
agent socket the edge's data path connects to.

Why the agent socket is a listening socket this object holds, apart from the channel:
the edge's data path (AgentClient) connects to a path, and a paused VM has no QEMU and
so no channel. The socket stays bound and listening across pause and resume, so a
request that arrives while a VM is restored waits in the socket's backlog and is served
the moment the new channel accepts: "any request to a paused microVM resumes it" with
no caller knowing. A restore that fails closes the socket, which fails those requests
(typed BackendError in AgentClient) instead of leaving them hanging.

Directory layout (``vm_dir``, root 0700): ``disk.img`` (the writable disk, chowned to
the jailed QEMU's uid at each launch), ``state.snap`` (while paused), ``qemu.log``
(QEMU's own stderr), ``agent.sock`` (the edge's), and ``q/`` (owned by the jailed QEMU:
only its QMP and chardev sockets, so a QEMU that a guest took over cannot replace the
edge's agent socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from dsec.backends.microvm.qemu import AGENT_CHARDEV, QemuProcess, VMConfig
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.backends.microvm.snapshot import load_into
from dsec.guest.channel import GuestChannel

log = logging.getLogger(__name__)

AGENT_BACKLOG = 512


def bind_agent_socket(path: Path) -> socket.socket:
    """The listening socket AgentClient connects to (mode 0600, root only)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    sock.listen(AGENT_BACKLOG)
    return sock


class Machine:
    """The live parts of one VM in this edge process (nothing here is persisted: the
    record's MicroVMFacts are; after an edge restart a new Machine adopts the QEMU)."""

    def __init__(self, vm_dir: Path, config: VMConfig) -> None:
        self.dir = vm_dir
        self.config = config
        self.proc: QemuProcess | None = None
        self.qmp: Qmp | None = None
        self.channel: GuestChannel | None = None
        self.listener: socket.socket | None = None
        self.restoring: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()  # one of boot / pause / restore at a time
        self.stopped = False  # SIGSTOPped by a pause: QMP would not answer
        self.ended: str | None = None  # why the backend ended this VM (death_reason)
        self._qmp_lock = asyncio.Lock()

    @property
    def agent_socket(self) -> Path:
        return self.dir / "agent.sock"

    @property
    def snapshot(self) -> Path:
        return self.dir / "state.snap"

    # -- channel ---------------------------------------------------------------------
    def listen(self) -> None:
        """Bind the edge's agent socket (once per edge process and VM)."""
        if self.listener is None:
            self.listener = bind_agent_socket(self.agent_socket)

    async def connect_channel(self, timeout: float) -> GuestChannel:
        """A new channel to the current QEMU's chardev, serving the agent socket."""
        self.listen()
        assert self.listener is not None
        await self.close_channel()
        channel = GuestChannel(
            self.config.agent_socket,
            self.agent_socket,
            sock=self.listener,
            connect_timeout=timeout,
        )
        await channel.start()
        self.channel = channel
        return channel

    async def close_channel(self) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            await channel.close()

    async def connect_qmp(self) -> Qmp:
        """The QMP link, opened once: QEMU serves one QMP client at a time, so two
        callers connecting at once would leave one without a greeting."""
        async with self._qmp_lock:
            assert self.proc is not None
            if self.qmp is None:
                self.qmp = await Qmp.connect(self.config.qmp_socket, alive=self.proc.is_alive)
            return self.qmp

    async def close_qmp(self) -> None:
        if self.qmp is not None:
            qmp, self.qmp = self.qmp, None
            with contextlib.suppress(Exception):
                await qmp.close()

    # -- processes -------------------------------------------------------------------
    def launch(self, *, prefix: Sequence[str], incoming: bool = False) -> QemuProcess:
        """Start QEMU (synchronously: a spawn), booting or waiting for a restore."""
        config = dataclasses.replace(self.config, incoming=self.snapshot if incoming else None)
        self.proc = QemuProcess.launch(config, prefix=prefix)
        return self.proc

    async def restore(self, source: Path, timeout: float) -> None:
        """Feed the launched (``incoming``) QEMU the state in ``source`` and run it."""
        assert self.proc is not None
        await load_into(await self.connect_qmp(), source, timeout=timeout)

    async def kill(self) -> None:
        """End QEMU and every link to it; idempotent."""
        await self.close_channel()
        await self.close_qmp()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            await asyncio.to_thread(proc.kill)

    def close_listener(self) -> None:
        """Refuse (and so fail) every request waiting for this VM."""
        if self.listener is not None:
            listener, self.listener = self.listener, None
            listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.agent_socket.unlink()

    async def close(self) -> None:
        """Forget this VM in this edge process without ending it (edge shutdown that
        leaves sandboxes running): the QEMU keeps running and is adopted next time."""
        if self.restoring is not None and not self.restoring.done():
            self.restoring.cancel()
            with contextlib.suppress(BaseException):
                await self.restoring
        await self.close_channel()
        await self.close_qmp()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    async def guest_ended(self) -> bool:
        """Whether the guest is over while QEMU still runs (it pauses on a guest
        shutdown or panic, keeping its console readable: see qemu.py)."""
        if self.proc is None or self.stopped or self.lock.locked():
            return False  # a create, pause or restore is using QMP: not now
        if self.restoring is not None and not self.restoring.done():
            return False
        return await self._ended_now()

    async def _ended_now(self) -> bool:
        """One QMP query: is the guest over? False while QMP is gone (the link is
        dropped, so the next ask connects again)."""
        try:
            qmp = await self.connect_qmp()
            return await qmp.guest_ended(timeout=2.0)
        except QmpError:
            await self.close_qmp()
            return False

    async def ends_within(self, grace: float) -> bool:
        """Whether the guest is seen over (as in ``guest_ended``) within ``grace``
        seconds (0: asked once), by a caller that holds ``lock``, which makes
        ``guest_ended`` answer False.

        Why wait: a guest that powers off shuts its devices down first, and its agent
        port closes with them; QEMU reaches its shutdown state only after that, a
        while later on a loaded host under TCG. Without the wait, a poweroff reads as
        "the guest broke its agent channel", which blames the wrong thing. The grace
        bounds the polling, not one query: a query cut short would drop the QMP link."""
        deadline = time.monotonic() + grace
        while self.proc is not None:
            if await self._ended_now():
                return True
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        return False

    async def agent_port_closed(self) -> bool:
        """Whether the guest holds its agent port closed (QMP ``query-chardev``): the
        guest's mux, the only program that keeps it open, has ended. Its link can then
        never answer, and a request sent on it would wait for its whole deadline; the
        host sees no garbage that would end the link by itself. False while unknown
        (QMP gone: the next poll asks again). The caller holds ``lock`` or knows
        nobody does (QMP serves one command at a time)."""
        if self.proc is None or self.stopped:
            return False
        if self.restoring is not None and not self.restoring.done():
            return False  # a restored guest reopens its port when it runs again
        try:
            qmp = await self.connect_qmp()
            return not await qmp.guest_opened(AGENT_CHARDEV, timeout=2.0)
        except QmpError:
            await self.close_qmp()
            return False

    async def console_tail(self, limit: int = 600) -> str:
        """The end of what the guest printed (for an error message), '' if unknown."""
        try:
            qmp = await self.connect_qmp()
            text = await qmp.console(timeout=2.0)
        except (QmpError, AssertionError):
            return ""
        return text[-limit:]


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a process (QEMU: the guest's touched RAM plus its own)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def wait_until(deadline: float) -> float:
    """Seconds left until ``deadline`` (time.monotonic), at least a little."""
    return max(0.5, deadline - time.monotonic())
