"""A small, typed QMP client over QEMU's own asyncio library (``qemu.qmp``).

``qemu.qmp`` does the protocol (greeting, capabilities negotiation, ids, events,
SCM_RIGHTS); this wraps it so that every call has a deadline and every failure is a
``QmpError`` (a ``BackendError``) with QEMU's own words, never a hang or a library
exception leaking to the API. The socket is QEMU's ``-mon`` chardev (server, no wait),
so a new edge can reconnect to a VM an older edge started.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qemu.qmp import ConnectError, ExecInterruptedError, ExecuteError, QMPClient, QMPError

from dsec import linux
from dsec.errors import BackendError

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT = 5.0
CONSOLE_KEEP = 16 * 1024
# Run states of a QEMU whose guest is over (powered off, panicked, pid 1 exited: see
# ``-action shutdown=pause`` in qemu.py): the process lives on only so that its
# console can be read; the owner kills it.
GUEST_ENDED = frozenset({"shutdown", "guest-panicked", "internal-error", "io-error"})


def _exists(path: Path) -> bool:
    return path.exists()


class QmpError(BackendError):
    """A QMP connection or command failed (QEMU's message in ``details['qemu']``)."""


class Qmp:
    """One QMP connection to one QEMU."""

    def __init__(self, socket: Path, *, name: str = "dsec-vmm") -> None:
        self.socket = socket
        self._client = QMPClient(name)
        self._console = bytearray()  # ringbuf-read consumes: keep what we read

    @classmethod
    async def connect(
        cls,
        socket: Path,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        alive: Callable[[], bool] | None = None,
    ) -> Qmp:
        """Connect, retrying until QEMU has created its socket or ``timeout``; with
        ``alive`` (e.g. ``QemuProcess.is_alive``), stop early once QEMU has exited."""
        qmp = cls(socket)
        deadline = time.monotonic() + timeout
        while True:
            if not _exists(socket) and time.monotonic() < deadline:
                # not created yet: wait here rather than let qemu.qmp log a failure
                if alive is not None and not alive():
                    raise QmpError(f"QEMU exited before creating its QMP socket {socket}")
                await asyncio.sleep(0.005)
                continue
            try:
                with linux.socket_path_nofollow(socket) as safe:  # QEMU can write there
                    await asyncio.wait_for(qmp._client.connect(safe), timeout)
                return qmp
            except (ConnectError, OSError, TimeoutError) as exc:
                with_msg = str(exc)
                await qmp._client.disconnect()
                if time.monotonic() >= deadline or (alive is not None and not alive()):
                    raise QmpError(f"cannot connect to QMP at {socket}: {with_msg}") from exc
                qmp._client = QMPClient("dsec-vmm")
                await asyncio.sleep(0.005)

    async def execute(
        self,
        cmd: str,
        arguments: Mapping[str, object] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Any:
        try:
            return await asyncio.wait_for(self._client.execute(cmd, arguments), timeout)
        except ExecuteError as exc:
            desc = exc.error.error.desc
            raise QmpError(f"QMP {cmd} failed: {desc}", qemu=desc) from exc
        except TimeoutError as exc:
            raise QmpError(f"QMP {cmd} got no answer within {timeout}s") from exc
        except (ExecInterruptedError, QMPError, OSError, EOFError) as exc:
            raise QmpError(f"QMP {cmd}: connection lost ({exc})") from exc

    async def status(self, timeout: float = DEFAULT_TIMEOUT) -> str:
        """QEMU's run state: 'running', 'paused', 'shutdown' (guest powered off or
        panicked, see qemu.py), 'inmigrate', 'postmigrate', ..."""
        reply = await self.execute("query-status", timeout=timeout)
        return str(reply["status"])

    async def guest_ended(self, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Whether the guest is over while QEMU still runs (read the console, kill)."""
        return await self.status(timeout) in GUEST_ENDED

    async def guest_opened(self, chardev: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Whether the guest has opened the device of ``chardev`` (a virtio-serial
        port: a guest program holds it open), False for no such chardev."""
        for dev in await self.execute("query-chardev", timeout=timeout):
            if dev.get("label") == chardev:
                return dev.get("frontend-open") is True
        return False

    async def send_fd(self, name: str, fd: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Hand QEMU one of our fds under ``name`` (getfd + SCM_RIGHTS): how QEMU gets
        a snapshot file it may not open itself (jailed, spawn denied)."""
        try:
            self._send_scm(fd)
        except (QMPError, OSError, AttributeError) as exc:
            raise QmpError(f"cannot pass an fd to QEMU: {exc}") from exc
        await self.execute("getfd", {"fdname": name}, timeout=timeout)

    def _send_scm(self, fd: int) -> None:
        """One byte carrying ``fd`` (SCM_RIGHTS) on the QMP socket, as QEMU wants it.

        Not ``QMPClient.send_fd_scm``: it reaches for the private ``_sock`` of
        asyncio's TransportSocket, which uvloop's transports (what `dsec up` runs on)
        do not have, so every pause, restore and template save failed there. A dup of
        the socket's fd works on any loop; between commands nothing else is queued on
        the transport, so the byte cannot interleave with a command."""
        writer = self._client._writer
        if writer is None:
            raise QmpError("QMP is not connected")
        raw = writer.transport.get_extra_info("socket")
        if raw is None or raw.family != socket.AF_UNIX:
            raise QmpError("passing an fd to QEMU needs its unix QMP socket")
        with socket.socket(fileno=os.dup(raw.fileno())) as sock:
            if socket.send_fds(sock, [b" "], [fd]) != 1:
                raise QmpError("short write passing an fd to QEMU")

    async def console(self, timeout: float = DEFAULT_TIMEOUT) -> str:
        """Everything the guest wrote to its serial console that we have read so far
        (the last CONSOLE_KEEP bytes): drains QEMU's ring into ours."""
        while True:
            chunk = await self.execute(
                "ringbuf-read",
                {"device": "console", "size": 65536, "format": "base64"},
                timeout=timeout,
            )
            data = base64.b64decode(str(chunk))
            if not data:
                break
            self._console += data
            del self._console[:-CONSOLE_KEEP]
        return self._console.decode(errors="replace")

    async def wait_console(self, marker: str, timeout: float) -> str:
        """Poll the console until ``marker`` appears; QmpError with the tail if not."""
        deadline = time.monotonic() + timeout
        while True:
            text = await self.console()
            if marker in text:
                return text
            if time.monotonic() > deadline:
                raise QmpError(
                    f"guest did not print {marker!r} within {timeout}s; console: {text[-2000:]!r}"
                )
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.disconnect(), DEFAULT_TIMEOUT)
        except (QMPError, OSError, TimeoutError, EOFError) as exc:
            log.debug("QMP disconnect from %s: %s", self.socket, exc)
