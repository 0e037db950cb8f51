"""Host end of a microVM's agent channel: one unix socket per VM that AgentClient uses
unchanged, multiplexed over the VM's single virtio-serial byte stream.

Why a mux: the agent protocol opens one connection per operation and relies on
half-close, while a VM has one virtio-serial port (no vhost-vsock on our hosts). Each
connection accepted on ``listen`` becomes a channel; the guest end (the mux process of
src/dsec/agent/dsec-vminit.c) connects to the agent's listening socket for it.

Wire format (the one description; dsec-vminit.c mirrors its constants)
---------------------------------------------------------------------
Every frame is ``u8 type | u32 channel | u32 length | payload[length]``, integers
little-endian, ``length <= 65536``. Types (host->guest ``h>g``, guest->host ``g>h``):

=====  =====  =========================================================================
``\0``  h>g    PREAMBLE: a host connects by sending 65545 zero bytes (a maximal frame)
              and then RESET. The guest may not have noticed the old host go and be
              in the middle of one of its frames; the zeros complete that frame, and a
              zero byte where a frame starts makes the guest drop the old link's
              channels and look for RESET. Nothing else ends a link in the guest: an
              EOF on its port is not ordered with the next host's bytes (port state
              and data come on different virtqueues), so the guest keeps its state
              across one and only stops reading until the port shows a host again.
``R``  h>g    RESET, channel 0, payload ``b"DSECRSET" + nonce[8]``: forget every channel
              (the guest closes its agent connections) and answer HELLO. The first
              frame of every link; the guest ignores all bytes before it.
``H``  g>h    HELLO, channel 0, payload ``b"DSECHELO" + nonce[8] + u8 state``: state
              1 = waiting for GO (template mode), 2 = the agent runs (READY),
              3 = booting. Sent for RESET and again on every state change. The host
              ignores every byte before the HELLO carrying its nonce (output of an
              older link), so a new host process gets a clean stream.
``G``  h>g    GO, channel 0, payload the boot parameters ``dsec.k=v ...`` (ASCII,
              at most 4096 bytes): template mode only, see the guest boot contract.
``O``  h>g    OPEN channel N: ids are chosen by the host, increase from 1 and are never
              reused within a link. The guest answers CLOSE if it cannot connect.
``D``  both   DATA, 1..65536 bytes. Never more than the receiver's free window.
``C``  both   CREDIT, payload u32: the receiver passed that many bytes on and grants
              them back to the sender's window. Every channel starts with a window of
              256 KiB in each direction, so one slow reader only stops its own channel.
``E``  both   EOF: the sender sends no more DATA (half-close, ``shutdown(SHUT_WR)``).
``X``  both   CLOSE: the sender forgot the channel (it closed its socket); no answer.
=====  =====  =========================================================================

A frame for a channel id that was never opened, an unknown type, a bad length, DATA
beyond the window or after EOF, or CREDIT beyond the window is a protocol violation:
everything from the guest is hostile. The host logs one line, closes the link (every
channel and the chardev connection) and reports it through ``wait_ready``; frames for
a channel closed meanwhile are ignored (both ends close independently).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

from dsec.errors import BackendError
from dsec.linux import socket_path_nofollow

log = logging.getLogger(__name__)

HDR = struct.Struct("<BII")
MAX_PAYLOAD = 65536
WINDOW = 256 * 1024
MAX_GO = 4096
RESET_MAGIC = b"DSECRSET"
HELLO_MAGIC = b"DSECHELO"
T_RESET, T_HELLO, T_GO, T_OPEN = b"R"[0], b"H"[0], b"G"[0], b"O"[0]
T_DATA, T_CREDIT, T_EOF, T_CLOSE = b"D"[0], b"C"[0], b"E"[0], b"X"[0]
ST_WAITING, ST_READY, ST_BOOTING = 1, 2, 3
PREAMBLE = bytes(HDR.size + MAX_PAYLOAD)
STALL_AFTER = 10.0
"""Seconds a request may wait for the guest's mux to take it (``stalled``)."""
HUNT_LIMIT = 64 << 20
"""Bytes of an older link's output the host skips while looking for its HELLO."""


class HoldWatch:
    """The VMs a watch loop saw held (a pause, a verify, a pack, a snapshot, a restore)
    since it last saw them free. A request sent to a held VM could not be taken, so at
    the first sight of it free again its stall window restarts (``restart_waits``):
    the guest is judged on time it had, never on the hold's."""

    def __init__(self) -> None:
        self._held: set[str] = set()

    def keep(self, live: Iterable[str]) -> None:
        """Forget VMs that are gone (the loop's set follows the backend's)."""
        self._held.intersection_update(live)

    def held(self, sid: str) -> None:
        self._held.add(sid)

    def freed(self, sid: str) -> bool:
        """True once, at the first free sight after a hold."""
        if sid not in self._held:
            return False
        self._held.discard(sid)
        return True


class ProtocolViolation(Exception):
    """The guest broke the wire format (internal: ends the link, never escapes)."""


def frame(type_: int, channel: int, payload: bytes = b"") -> bytes:
    return HDR.pack(type_, channel, len(payload)) + payload


class _Channel:
    """One accepted connection and its state on the host end."""

    def __init__(self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.id = cid
        self.reader = reader
        self.writer = writer
        self.credit = WINDOW  # bytes we may still send the guest
        self.credit_changed = asyncio.Event()
        self.queue: deque[bytes] = deque()  # from the guest, not yet written to the client
        self.unacked = 0  # received from the guest, not yet granted back by a CREDIT
        self.queue_changed = asyncio.Event()
        self.guest_eof = False
        self.guest_closed = False
        self.gone = False  # forgotten by the host (CLOSE sent or received)
        self.tasks: list[asyncio.Task[None]] = []
        # When the host sent the channel's first DATA (its request) and the guest has
        # not yet said a word on it (see GuestChannel.stalled_for); None otherwise.
        self.owed_since: float | None = None
        self.answered = False


class GuestChannel:
    """The agent channel of one VM, in the edge's event loop.

    ``chardev`` is QEMU's ``-chardev socket,server=on`` path; ``listen`` the socket
    AgentClient connects to (created mode 0600, removed by ``close``)."""

    def __init__(
        self,
        chardev: Path,
        listen: Path,
        *,
        connect_timeout: float = 30.0,
        sock: socket.socket | None = None,
    ) -> None:
        self.chardev = chardev
        self.listen = listen
        # A listening socket the caller owns at ``listen`` (kept across channels: a VM
        # restored into a new QEMU gets a new channel, and requests that arrived
        # meanwhile wait in its backlog). The channel serves a dup of it and never
        # unlinks ``listen``.
        self._sock = sock
        self.connect_timeout = connect_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.base_events.Server | None = None
        self._nonce = secrets.token_bytes(8)
        self._state = 0
        self._synced = asyncio.Event()
        self._state_changed = asyncio.Event()
        self._lost: str | None = None
        self._lost_event = asyncio.Event()
        self._channels: dict[int, _Channel] = {}
        self._next_id = 1
        self._pending = bytearray()  # read from the chardev, not yet parsed
        self._read_task: asyncio.Task[None] | None = None
        self._client_tasks: set[asyncio.Task[None]] = set()

    # -- public ---------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while the link to QEMU's chardev is up and not broken."""
        return self._writer is not None and self._lost is None

    @property
    def lost(self) -> str | None:
        """Why the link ended (a protocol violation, QEMU closed it, ``close``), or None
        while it is up."""
        return self._lost

    @property
    def state(self) -> int:
        """The guest's last HELLO state (0 before the first)."""
        return self._state

    async def start(self) -> None:
        """Connect to QEMU's chardev (retrying until it exists), send RESET, serve
        ``listen``. Raises BackendError when the chardev never accepts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        while True:
            try:
                with socket_path_nofollow(self.chardev) as safe:  # QEMU can write there
                    self._reader, self._writer = await asyncio.open_unix_connection(safe)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() > deadline:
                    raise BackendError(
                        f"the VM's agent channel {self.chardev} does not accept: {exc}"
                    ) from exc
                await asyncio.sleep(0.02)
            except OSError as exc:  # a link or a file in the socket's place: never retried
                raise BackendError(f"the VM's agent channel {self.chardev}: {exc}") from exc
        self._writer.write(PREAMBLE + frame(T_RESET, 0, RESET_MAGIC + self._nonce))
        self._read_task = asyncio.create_task(self._read_loop(), name="guest-channel-read")
        if self._sock is not None:
            served = socket.socket(fileno=os.dup(self._sock.fileno()))
            self._server = await asyncio.start_unix_server(self._on_client, sock=served)
            return
        with contextlib.suppress(FileNotFoundError):
            self.listen.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._on_client, str(self.listen))
        finally:
            os.umask(old)

    async def wait_ready(self, timeout: float) -> None:
        """Until the guest's agent listens (HELLO state READY). BackendError on timeout
        or when the link is lost."""
        await self._wait_state(ST_READY, timeout)

    async def wait_template(self, timeout: float) -> None:
        """Until a template-mode guest waits for GO (HELLO state WAITING)."""
        await self._wait_state(ST_WAITING, timeout)

    async def go(self, params: Mapping[str, str]) -> None:
        """Send a template-mode guest its boot parameters (``{"layers": "2", ...}``,
        spelled without the ``dsec.`` prefix)."""
        for key, value in params.items():
            if not key.isidentifier() or not value or any(c.isspace() or c == "\0" for c in value):
                raise BackendError(f"bad GO parameter {key}={value!r}")
        text = " ".join(f"dsec.{k}={v}" for k, v in params.items()).encode("ascii")
        if len(text) > MAX_GO:
            raise BackendError(f"GO parameters are {len(text)} bytes, at most {MAX_GO}")
        await self._synced.wait()
        self._send(frame(T_GO, 0, text))
        await self._drain()

    def stalled_for(self) -> float:
        """Seconds the oldest request the guest has not taken has waited (0.0: none).

        A channel's first DATA is its request, and the guest's mux answers it with a
        CREDIT as soon as it has passed those bytes to the agent's socket, whose buffer
        is empty then: whatever the agent does with the request (a command that runs
        for hours), the mux's word on it comes at once. A request nobody took for
        seconds means the mux does not run (stopped by the guest, or the guest hung),
        where no garbage and no closed port would ever tell. Later DATA is not
        counted: a command that does not read its stdin stops its window, rightly."""
        now = asyncio.get_running_loop().time()
        waits = [now - ch.owed_since for ch in self._channels.values() if ch.owed_since is not None]
        return max(waits, default=0.0)

    def stalled(self) -> str | None:
        """Why the link counts as dead although the port is open and nothing on it
        is garbage: a request untaken for STALL_AFTER (see ``stalled_for``); None
        while every request was taken in time."""
        waited = self.stalled_for()
        if waited < STALL_AFTER:
            return None
        return f"the guest took no request for {waited:.0f}s (its mux stopped or hung)"

    def restart_waits(self) -> None:
        """Count every untaken request's wait from now: the guest could not take it
        while its VMM was held (SIGSTOPped by a pause, a verify or a pack; vCPUs
        stopped for a snapshot), and once it runs again it gets the whole stall
        window rather than being judged on time it never had."""
        now = asyncio.get_running_loop().time()
        for ch in self._channels.values():
            if ch.owed_since is not None:
                ch.owed_since = now

    def abandon(self, why: str) -> None:
        """End the link for a reason the host saw elsewhere (``stalled_for``): every
        channel's client is closed, ``lost`` says ``why``; the caller links anew."""
        self._lose(why)

    async def close(self) -> None:
        """Close the server, every channel and the chardev connection; remove ``listen``."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._lose("closed", quiet=True)
        # Losing the link woke every client task (closed writers, set events): let them
        # end by themselves, so asyncio's server never sees a cancelled callback.
        if self._client_tasks:
            _, late = await asyncio.wait(list(self._client_tasks), timeout=5)
            for task in late:
                task.cancel()
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(BaseException):
                await self._read_task
        if self._sock is None:
            with contextlib.suppress(FileNotFoundError):
                self.listen.unlink()

    # -- link -----------------------------------------------------------------------

    async def _wait_state(self, want: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._lost is not None:
                raise BackendError(f"the VM's agent channel was lost: {self._lost}")
            if self._state == want:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise BackendError(
                    f"the VM's agent did not become ready within {timeout:.1f}s "
                    f"(guest state {self._state})"
                )
            self._state_changed.clear()
            waiters = [
                asyncio.create_task(self._state_changed.wait()),
                asyncio.create_task(self._lost_event.wait()),
            ]
            try:
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def _send(self, data: bytes) -> None:
        if self._writer is not None and self._lost is None:
            self._writer.write(data)

    async def _drain(self) -> None:
        if self._writer is not None and self._lost is None:
            try:
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                self._lose(f"write to the chardev failed: {exc}")

    def _lose(self, why: str, *, quiet: bool = False) -> None:
        """End the link: every channel's client is closed, ``wait_ready`` raises."""
        if self._lost is not None:
            return
        if not quiet:
            log.warning("agent channel %s: link closed: %s", self.chardev, why)
        self._lost = why
        self._lost_event.set()
        self._synced.set()  # nobody waits for a sync that will never come
        for ch in list(self._channels.values()):
            self._forget(ch, tell=False)
            ch.queue.clear()  # what a broken link delivered is not passed on
            ch.writer.close()
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            await self._hunt_hello()
            while True:
                type_, cid, n = HDR.unpack(await self._take(HDR.size))
                if n > MAX_PAYLOAD:
                    raise ProtocolViolation(f"frame of {n} bytes")
                self._on_frame(type_, cid, await self._take(n))
        except ProtocolViolation as exc:
            self._lose(f"protocol violation: {exc}")
        except asyncio.IncompleteReadError:
            self._lose("QEMU closed the chardev (the VM ended?)")
        except (ConnectionError, OSError) as exc:
            self._lose(f"chardev read failed: {exc}")

    async def _fill(self) -> None:
        assert self._reader is not None
        chunk = await self._reader.read(4 * MAX_PAYLOAD)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(self._pending), None)
        self._pending += chunk

    async def _take(self, n: int) -> bytes:
        """Exactly ``n`` bytes of the stream (n is bounded by the caller)."""
        while len(self._pending) < n:
            await self._fill()
        out = bytes(self._pending[:n])
        del self._pending[:n]
        return out

    async def _hunt_hello(self) -> None:
        """Skip an older link's bytes up to the HELLO that answers our RESET."""
        pattern = HDR.pack(T_HELLO, 0, 17) + HELLO_MAGIC + self._nonce
        skipped = 0
        while (at := self._pending.find(pattern)) < 0:
            keep = len(pattern) - 1
            if len(self._pending) > keep:
                skipped += len(self._pending) - keep
                del self._pending[:-keep]
            if skipped > HUNT_LIMIT:
                raise ProtocolViolation("no HELLO answers our RESET")
            await self._fill()
        del self._pending[: at + len(pattern)]
        self._set_state((await self._take(1))[0])
        self._synced.set()

    def _set_state(self, state: int) -> None:
        if state not in (ST_WAITING, ST_READY, ST_BOOTING):
            raise ProtocolViolation(f"HELLO with state {state}")
        self._state = state
        self._state_changed.set()

    def _on_frame(self, type_: int, cid: int, payload: bytes) -> None:
        n = len(payload)
        if type_ == T_HELLO:
            if cid or n != 17 or payload[:16] != HELLO_MAGIC + self._nonce:
                raise ProtocolViolation("HELLO for another link")
            self._set_state(payload[16])
            return
        if type_ not in (T_DATA, T_CREDIT, T_EOF, T_CLOSE):
            raise ProtocolViolation(f"frame type {type_}")
        if cid == 0 or cid >= self._next_id:
            raise ProtocolViolation(f"frame for channel {cid}, never opened")
        ch = self._channels.get(cid)
        if ch is not None:
            ch.answered, ch.owed_since = True, None
        if type_ == T_DATA:
            if n == 0:
                raise ProtocolViolation("empty DATA")
            if ch is None:
                return  # closed meanwhile: its bytes go nowhere
            if ch.guest_eof:
                raise ProtocolViolation(f"DATA after EOF on channel {cid}")
            if ch.unacked + n > WINDOW:
                raise ProtocolViolation(f"DATA past the window on channel {cid}")
            ch.queue.append(payload)
            ch.unacked += n
            ch.queue_changed.set()
        elif type_ == T_CREDIT:
            if n != 4:
                raise ProtocolViolation("CREDIT length")
            (grant,) = struct.unpack("<I", payload)
            if ch is None:
                return
            if ch.credit + grant > WINDOW:
                raise ProtocolViolation(f"CREDIT past the window on channel {cid}")
            ch.credit += grant
            ch.credit_changed.set()
        else:
            if n:
                raise ProtocolViolation("EOF/CLOSE with a payload")
            if ch is None:
                return
            if type_ == T_EOF:
                if ch.guest_eof:
                    raise ProtocolViolation("second EOF")
                ch.guest_eof = True
            else:
                ch.guest_closed = True
                self._forget(ch, tell=False)
            ch.queue_changed.set()

    # -- channels -------------------------------------------------------------------

    def _forget(self, ch: _Channel, *, tell: bool) -> None:
        if ch.gone:
            return
        ch.gone = True
        self._channels.pop(ch.id, None)
        if tell:
            self._send(frame(T_CLOSE, ch.id))
        ch.credit_changed.set()
        ch.queue_changed.set()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._client_tasks.add(task)
        try:
            await self._synced.wait()
            if self._lost is not None:
                return
            ch = _Channel(self._next_id, reader, writer)
            self._next_id += 1
            self._channels[ch.id] = ch
            self._send(frame(T_OPEN, ch.id))
            up = asyncio.create_task(self._client_to_guest(ch))
            try:
                await self._guest_to_client(ch)
            finally:
                up.cancel()
                with contextlib.suppress(BaseException):
                    await up
                self._forget(ch, tell=True)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # close() gave up waiting; asyncio would log a cancelled callback task
        finally:
            writer.close()
            with contextlib.suppress(BaseException):
                await writer.wait_closed()
            self._client_tasks.discard(task)

    async def _client_to_guest(self, ch: _Channel) -> None:
        try:
            while not ch.gone:
                while ch.credit == 0 and not ch.gone:
                    ch.credit_changed.clear()
                    await ch.credit_changed.wait()
                if ch.gone:
                    return
                data = await ch.reader.read(min(ch.credit, MAX_PAYLOAD))
                if ch.gone:
                    return
                if not data:
                    self._send(frame(T_EOF, ch.id))
                    return
                ch.credit -= len(data)
                if not ch.answered and ch.owed_since is None:
                    ch.owed_since = asyncio.get_running_loop().time()
                self._send(frame(T_DATA, ch.id, data))
                await self._drain()
        except (ConnectionError, OSError):
            # The client broke its connection: the guest forgets the channel too.
            self._forget(ch, tell=True)
            ch.queue_changed.set()

    async def _guest_to_client(self, ch: _Channel) -> None:
        eof_written = False
        while True:
            while ch.queue and not ch.writer.is_closing():
                data = ch.queue.popleft()
                ch.writer.write(data)
                await ch.writer.drain()
                ch.unacked -= len(data)
                if not ch.gone:
                    self._send(frame(T_CREDIT, ch.id, struct.pack("<I", len(data))))
            if ch.gone:
                return
            if ch.guest_eof and not eof_written:
                if ch.writer.can_write_eof():
                    ch.writer.write_eof()
                eof_written = True
            ch.queue_changed.clear()
            await ch.queue_changed.wait()
