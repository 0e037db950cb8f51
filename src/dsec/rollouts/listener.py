"""The model gateway's listening socket outlives the edge that opened it.

A scaffold's model call held by the gateway (the trainer is away) is a TCP connection
to the edge. When the edge dies (SIGKILL, OOM, a crash), the kernel closes that
connection, and the scaffold's client sees a reset. The OpenAI client (and most
others) retries a reset connection, but only a couple of times within about two
seconds (``openai``: 2 retries, 0.5 s then 1 s): far shorter than an edge restart. If
the port were closed meanwhile, those retries would be refused and the call lost.

So the listening socket is held by a small keeper process of its own (this module run
run as a script: ``python -I listener.py PATH``), which hands it over (SCM_RIGHTS on a
root-only unix socket) to the edge that starts next. While no edge runs, the kernel
still completes the handshake of a retry and queues it in the socket's backlog; the
restarted edge's gateway accepts it and serves it like any call: held until the
trainer answers, recorded once (the call the dead edge held was never answered, so
never recorded). A retry carries the client's retry count
(``x-stainless-retry-count``), which is logged with the call.

The keeper exits when told to (an edge that stops its sandboxes on exit has no
scaffold left to wait for) or when no edge has been attached for ``ORPHAN_S`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: How long the keeper waits for an edge to come back before it lets the port go.
ORPHAN_S = float(os.environ.get("DSEC_GATEWAY_KEEPER_ORPHAN_S", "900"))
GET, PUT, QUIT = b"G", b"P", b"Q"
FOUND, NONE, OK = b"F", b"N", b"K"


class ListenerKeeper:
    """The edge's side: get the gateway's listening socket, from the keeper if one
    runs, else a new one (then a keeper is started to hold it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: socket.socket | None = None

    @property
    def kept(self) -> bool:
        return self._conn is not None

    def acquire(self, port: int) -> socket.socket:
        """A listening TCP socket on ``port`` (all addresses): the keeper's if one
        runs, else a new one (``keep`` hands it to a keeper once rollouts use it).
        OSError when the port cannot be bound (taken while no keeper held it)."""
        held = self._from_keeper()
        if held is not None:
            if held.getsockname()[1] == port:
                return held
            held.close()  # another port was asked for: let the old one go
            self.release(quit=True)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        return sock

    def keep(self, sock: socket.socket) -> None:
        """Have a keeper hold ``sock`` (idempotent). A failure costs only the survival
        of held calls across an edge death: logged, not raised."""
        if self._conn is not None:
            return
        try:
            self._hand_over(sock)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("gateway socket keeper: %s; held calls die with this edge", exc)

    def _connect(self) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(5.0)
        try:
            conn.connect(str(self.path))
        except OSError:
            conn.close()
            return None
        return conn

    def _from_keeper(self) -> socket.socket | None:
        conn = self._connect()
        if conn is None:
            return None
        try:
            conn.sendall(GET)
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 1)
        except OSError:
            conn.close()
            return None
        if msg != FOUND or not fds:
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        self._conn = conn  # stays open: the keeper knows an edge is attached
        return socket.socket(fileno=fds[0])

    def _hand_over(self, sock: socket.socket) -> None:
        """Start a keeper (if none answers) and give it a duplicate of ``sock``. A
        failure here costs only the survival of held calls: logged by the caller."""
        conn = self._connect()
        if conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            # The keeper daemonises once its socket listens (its first process exits).
            subprocess.run(  # this file as a script: stdlib only, no dsec import
                [sys.executable, "-I", __file__, str(self.path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                check=True,
                timeout=30,
            )
            conn = self._connect()
            if conn is None:
                raise OSError(f"the gateway's socket keeper did not answer at {self.path}")
        socket.send_fds(conn, [PUT], [sock.fileno()])
        if conn.recv(1) != OK:
            conn.close()
            raise OSError("the gateway's socket keeper refused the socket")
        if self._conn is not None:
            self._conn.close()
        self._conn = conn

    def release(self, *, quit: bool) -> None:
        """Detach; ``quit``: the keeper closes the socket and exits (no scaffold will
        call again)."""
        conn = self._conn or (self._connect() if quit else None)
        self._conn = None
        if conn is None:
            return
        with contextlib.suppress(OSError):
            if quit:
                conn.sendall(QUIT)
                conn.recv(1)
        conn.close()


def serve(path: str) -> None:
    """The keeper: hold the listening socket; give it to each edge that asks."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        server.bind(path)
    finally:
        os.umask(old)
    server.listen(8)
    if os.fork() > 0:  # the edge waits for this exit: the socket listens by now
        os._exit(0)
    os.setsid()
    held: socket.socket | None = None
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    attached: set[socket.socket] = set()
    alone_since = time.monotonic()
    while os.path.exists(path):  # gone with its data dir: nobody will come back
        if attached:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since > ORPHAN_S:
            break
        for key, _ in sel.select(timeout=5.0):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if s is server:
                conn, _ = server.accept()
                attached.add(conn)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                msg, fds, _flags, _addr = socket.recv_fds(s, 1, 1)
            except OSError:
                msg, fds = b"", []
            if msg == PUT and fds:
                if held is not None:
                    held.close()
                held = socket.socket(fileno=fds[0])
                s.sendall(OK)
            elif msg == GET:
                if held is not None:
                    socket.send_fds(s, [FOUND], [held.fileno()])
                else:
                    s.sendall(NONE)
            elif msg == QUIT:
                with contextlib.suppress(OSError):
                    s.sendall(OK)
                if held is not None:
                    held.close()
                with contextlib.suppress(OSError):
                    os.unlink(path)
                return
            else:  # the edge went away (closed, or died)
                for fd in fds:
                    os.close(fd)
                sel.unregister(s)
                attached.discard(s)
                s.close()
    with contextlib.suppress(OSError):
        os.unlink(path)


if __name__ == "__main__":
    serve(sys.argv[1])
