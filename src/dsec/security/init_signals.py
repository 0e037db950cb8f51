"""The edge side of pid 1's signal reports: every signal a sandbox sends its own pid 1.

pid 1 (dsec-init) ignores every signal whose sender is inside the sandbox: only the
host ends a sandbox. The seccomp profile refuses and records ``kill``/``tgkill``/...
aimed at pid 1 (``dsec.security.seccomp.SIGNAL_CALLS``), but some paths carry no pid a
filter can read: ``pidfd_send_signal`` on a pidfd or a ``/proc/1`` fd, ``F_SETOWN`` +
``F_SETSIG`` on any fd (the kernel then signals pid 1 itself), a process group. What
arrives that way pid 1 reads from its signalfd and reports on a connection the edge
holds open to its agent socket (operation ``N``; frame ``G``, see dsec-init.c). This
module holds one such connection per sandbox on the edge's event loop (no thread: a
report is a few bytes, and an idle connection costs nothing) and turns each report
into a ``signal_to_init`` event, rate-limited per sandbox like the seccomp listener.
Two ways to hold it. ``watch``: open for the sandbox's life; it ends when pid 1 does,
so it doubles as the edge's death watch of the init (``on_closed``, dsec.edge.deaths).
``drain``: opened when pid 1 rings its doorbell (it holds reports and nobody listens;
the seccomp listener hears the ring, dsec.security.seccomp_listener), the edge sends
``N`` and shuts its write side at once, pid 1 hands over what it holds and shuts its
own, and the connection is gone within milliseconds; the seccomp notify fd is the death
watch then. A sandbox with a notify fd costs the edge that one fd; one without (an
adopted sandbox: the notify fd died with the old edge) the long-lived connection.

Everything in a report is the sandbox's word except what the kernel filled in: the
signal, the si_code, and the sender's pid for SI_USER/SI_TKILL. A queued signal
(SI_QUEUE and the other negative codes) carries a pid of the sender's choosing, so the
event says ``pid_claimed`` there; ``comm`` is whatever the sender named itself.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.api.events import EventKind
from dsec.security.audit import AuditSink
from dsec.security.seccomp_listener import BURST, WINDOW, signal_name

log = logging.getLogger(__name__)

OP_WATCH = ord("N")  # first frame: this connection receives pid 1's signal reports
T_SIGNAL = ord("G")  # one report (or, with signo 0, a count of reports that were lost)
_HDR = struct.Struct("<BI")
_NOTE = struct.Struct("<IiIII16s")  # signo, si_code, pid, uid, not itemised before, comm
_MAX_FRAME = 4096  # a report is 36 bytes; anything larger is a broken agent
_RETRY = (0.05, 0.5, 2.0)  # connect attempts after the first (a full backlog)

SI_CODES = {0: "SI_USER", 0x80: "SI_KERNEL", -1: "SI_QUEUE", -2: "SI_TIMER",
            -3: "SI_MESGQ", -4: "SI_ASYNCIO", -5: "SI_SIGIO", -6: "SI_TKILL"}  # fmt: skip
_POLL_CODES = ("POLL_IN", "POLL_OUT", "POLL_MSG", "POLL_ERR", "POLL_PRI", "POLL_HUP")
_CLD_CODES = ("CLD_EXITED", "CLD_KILLED", "CLD_DUMPED", "CLD_TRAPPED", "CLD_STOPPED",
              "CLD_CONTINUED")  # fmt: skip
_KERNEL_PID = (0, -6)  # SI_USER, SI_TKILL: the kernel wrote the sender's pid


def code_name(signo: int, code: int) -> str:
    """The si_code's name; 1..6 are per-signal (F_SETSIG's POLL_* for most signals)."""
    if code in SI_CODES:
        return SI_CODES[code]
    if 1 <= code <= 6:
        return (_CLD_CODES if signo == 17 else _POLL_CODES)[code - 1]
    return str(code)


def describe(note: bytes) -> dict[str, Any]:
    """The event detail of one ``G`` payload (all of it untrusted but the kernel's
    fields; see the module docstring)."""
    signo, code, pid, uid, before, comm = _NOTE.unpack(note[: _NOTE.size])
    if signo == 0:
        return {"not_itemised": before, "via": "init", "action": "ignored"}
    detail: dict[str, Any] = {
        "signal": signal_name(signo),
        "signo": signo,
        "code": code_name(signo, code),
        "via": "init",
        "action": "ignored",
        "uid": uid,
    }
    detail["pid" if code in _KERNEL_PID else "pid_claimed"] = pid
    text = comm.split(b"\0", 1)[0].decode(errors="replace")
    if text:
        detail["comm"] = text
    if before:
        detail["not_itemised_before"] = before
    return detail


@dataclass
class _Watch:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    transient: bool = False  # a drain: ends by design, not a death
    again: bool = False  # a drain rang for while this one ran: open another after it
    then_watch: Path | None = None  # a lasting watch asked for while this drain ran


class InitSignalWatcher:
    """pid 1's signal reports of every sandbox of one edge, on its event loop."""

    def __init__(self, audit: AuditSink) -> None:
        self.audit = audit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watches: dict[str, _Watch] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._rate: dict[str, list[float]] = {}
        self._suppressed: dict[str, int] = {}
        self._report_as: dict[str, str] = {}  # a verifier's reports are its sandbox's
        # Told the sandbox id when a connection ends other than by unwatch(): pid 1
        # died (or closed it, or broke the protocol). The edge's death watch.
        self.on_closed: Callable[[str], None] = lambda sandbox_id: None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        for sid in list(self._watches) + list(self._retries):
            self.unwatch(sid)
        self._loop = None

    def watching(self, sandbox_id: str) -> bool:
        """Whether a lasting connection (not a drain) is open to ``sandbox_id``'s pid 1:
        then its end is pid 1's (``on_closed``)."""
        w = self._watches.get(sandbox_id)
        return w is not None and not w.transient

    def watch(
        self, sandbox_id: str, agent_socket: Path, attempt: int = 0, *, report_as: str | None = None
    ) -> None:
        """Open the report connection (at create and at adoption: a restarted edge gets
        what pid 1 kept meanwhile). Never blocks: a unix connect either completes at
        once or finds the backlog full (then a few retries). ``report_as``: record the
        events under that sandbox (a verifier's pid 1 reports for the graded one)."""
        if self._loop is None:
            return
        current = self._watches.get(sandbox_id)
        if current is not None and current.transient:
            current.then_watch = agent_socket  # after it: what it carries is not lost
            if report_as is not None:
                self._report_as[sandbox_id] = report_as
            return
        self.unwatch(sandbox_id)
        if report_as is not None:
            self._report_as[sandbox_id] = report_as
        self._open(sandbox_id, agent_socket, attempt, transient=False)

    def drain(self, sandbox_id: str, agent_socket: Path, attempt: int = 0) -> None:
        """Collect what pid 1 holds now over a short connection (its doorbell rang);
        nothing to do while a lasting watch is open (it gets every report)."""
        if self._loop is None:
            return
        current = self._watches.get(sandbox_id)
        if current is not None:
            current.again = current.transient
            return
        if sandbox_id in self._retries and attempt == 0:
            return  # a connect is due anyway
        self._open(sandbox_id, agent_socket, attempt, transient=True)

    def _open(self, sandbox_id: str, agent_socket: Path, attempt: int, *, transient: bool) -> None:
        assert self._loop is not None
        self._retries.pop(sandbox_id, None)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            sock.connect(str(agent_socket))
            sock.send(_HDR.pack(OP_WATCH, 0))
            if transient:
                sock.shutdown(socket.SHUT_WR)  # pid 1 sends what it holds, then ends
        except OSError as exc:
            sock.close()
            if attempt < len(_RETRY):
                report_as = self._report_as.get(sandbox_id)
                self._retries[sandbox_id] = self._loop.call_later(
                    _RETRY[attempt],
                    lambda: (
                        self.drain(sandbox_id, agent_socket, attempt + 1)
                        if transient
                        else self.watch(sandbox_id, agent_socket, attempt + 1, report_as=report_as)
                    ),
                )
            else:
                log.warning("sandbox %s: no signal reports from pid 1: %s", sandbox_id, exc)
            return
        self._watches[sandbox_id] = _Watch(sock, transient=transient)
        self._loop.add_reader(sock.fileno(), self._readable, sandbox_id, agent_socket)

    def unwatch(self, sandbox_id: str) -> None:
        retry = self._retries.pop(sandbox_id, None)
        if retry is not None:
            retry.cancel()
        w = self._watches.pop(sandbox_id, None)
        if w is not None:
            if self._loop is not None:
                self._loop.remove_reader(w.sock.fileno())
            w.sock.close()
        self._rate.pop(sandbox_id, None)
        self._suppressed.pop(sandbox_id, None)
        self._report_as.pop(sandbox_id, None)

    def _drained(self, sandbox_id: str, agent_socket: Path) -> None:
        """A drain read up to pid 1's end: close it, and open what was asked meanwhile."""
        w = self._watches.pop(sandbox_id)
        if self._loop is not None:
            self._loop.remove_reader(w.sock.fileno())
        w.sock.close()
        if w.then_watch is not None:
            self.watch(sandbox_id, w.then_watch, report_as=self._report_as.get(sandbox_id))
        elif w.again:
            self.drain(sandbox_id, agent_socket)

    @property
    def open_connections(self) -> int:
        """Connections held now (fds): lasting watches and drains in flight."""
        return len(self._watches)

    def _closed(self, sandbox_id: str) -> None:
        self.unwatch(sandbox_id)
        try:
            self.on_closed(sandbox_id)
        except Exception:
            log.exception("sandbox %s: handling the end of its report connection", sandbox_id)

    def _readable(self, sandbox_id: str, agent_socket: Path) -> None:
        w = self._watches.get(sandbox_id)
        if w is None:
            return
        try:
            data = w.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data and w.transient:  # pid 1 handed over what it held
            self._drained(sandbox_id, agent_socket)
            return
        if not data:  # pid 1 is gone (the sandbox ended) or closed us for a newer edge
            self._closed(sandbox_id)
            return
        w.buf += data
        while len(w.buf) >= _HDR.size:
            kind, size = _HDR.unpack_from(w.buf)
            if size > _MAX_FRAME:
                log.warning("sandbox %s: malformed signal report; not watching", sandbox_id)
                self._closed(sandbox_id)
                return
            if len(w.buf) < _HDR.size + size:
                break
            payload = bytes(w.buf[_HDR.size : _HDR.size + size])
            del w.buf[: _HDR.size + size]
            if kind == T_SIGNAL and size >= _NOTE.size:
                self._record(sandbox_id, describe(payload))

    def _record(self, sandbox_id: str, detail: dict[str, Any]) -> None:
        """At most BURST events per sandbox per WINDOW seconds; the rest are counted and
        the count rides on the next recorded event (as in the seccomp listener)."""
        now = time.monotonic()
        times = [t for t in self._rate.get(sandbox_id, []) if now - t < WINDOW]
        if len(times) >= BURST:
            self._rate[sandbox_id] = times
            self._suppressed[sandbox_id] = self._suppressed.get(sandbox_id, 0) + max(
                1, int(detail.get("not_itemised", 0))
            )
            return
        times.append(now)
        self._rate[sandbox_id] = times
        dropped = self._suppressed.pop(sandbox_id, 0)
        if dropped:
            detail["suppressed_before"] = dropped
        owner = self._report_as.get(sandbox_id, sandbox_id)
        self.audit.event(owner, EventKind.SIGNAL_TO_INIT, **detail)
