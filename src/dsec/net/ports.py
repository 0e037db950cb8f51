"""The ports servers listen on: binding one first, and picking a free one.

``listen`` binds a server's socket before the server does any other work (so a taken
port is said at once, in words) and serves port 0. ``free_port`` is for a server that
another process will bind a moment later (a test's platform, a database).

The usual trick for that, ``bind(("127.0.0.1", 0))`` and close, hands out a port from the
kernel's *ephemeral* range (``net.ipv4.ip_local_port_range``). Between the close and the
server's own bind, every outgoing connection on the host draws its source port from that
same range, so on a busy host the port can be taken first and the server fails with
EADDRINUSE: a test platform did exactly that in CI (`dsec up` exiting with "[Errno 98]
... address already in use"). A port *outside* the ephemeral range is never given to an
outgoing connection, so only another explicit bind can take it; ``slot``/``slots`` split
that range between cooperating pickers (the test suite's parallel workers), so they never
hand out the same port either.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

from dsec.errors import CannotListen

# Below this are the well-known and commonly configured ports (ssh, databases,
# Prometheus, ...): not ours to hand out even when free at this moment.
LOWEST = 10_000
HIGHEST = 65_535
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux's default if
    it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def candidate_ports(slot: int = 0, slots: int = 1) -> list[int]:
    """The ports outside the ephemeral range from LOWEST up, every ``slots``-th one
    starting at ``slot`` (so that pickers with different slots never share one)."""
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is not in 0..{slots - 1}")
    low, high = ephemeral_range()
    ports = [p for p in range(LOWEST, HIGHEST + 1) if not low <= p <= high]
    return ports[slot::slots]


_cursor: dict[tuple[int, int], int] = {}  # (slot, slots) -> next index into the candidates


def free_port(host: str = "127.0.0.1", *, slot: int = 0, slots: int = 1) -> int:
    """A port on ``host`` that nothing is bound to now and that no outgoing connection
    will take before the caller's server binds it (see the module's docstring).

    Raises OSError(EADDRINUSE) if every candidate is taken."""
    ports = candidate_ports(slot, slots)
    # A cursor per process, from a random start: two picks in a row never hand out
    # the same port, even when the first one's server has not bound it yet.
    start = _cursor.get((slot, slots), random.randrange(len(ports)))
    _cursor[(slot, slots)] = (start + 1) % len(ports)
    for offset in range(len(ports)):
        port = ports[(start + offset) % len(ports)]
        with socket.socket() as sock:
            try:
                # No SO_REUSEADDR: a port still in TIME_WAIT is skipped as well, since
                # a server without that option could not bind it either.
                sock.bind((host, port))
            except OSError:
                continue
            _cursor[(slot, slots)] = (start + offset + 1) % len(ports)
            return port
    raise OSError(errno.EADDRINUSE, f"no free port on {host} outside the ephemeral range")


# uvicorn's default: connections the kernel completes before the server accepts them.
LISTEN_BACKLOG = 2048

# Why a bind fails, in the words an operator acts on.
LISTEN_FAILURES = {
    errno.EADDRINUSE: "another process listens there (another `dsec up`?); choose --port",
    errno.EADDRNOTAVAIL: "no interface of this host has that address; choose --host",
    errno.EACCES: "ports below 1024 need root (CAP_NET_BIND_SERVICE)",
}


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything else starts.

    Every server command binds first and serves on this socket afterwards
    (dsec.roots.serving.serve_app, the layer store's server), so that a port already
    taken fails at once, with a message that says so, before the platform has
    recovered sandboxes, mounted images or opened databases only to give it all back;
    and so that port 0 (any free port) gives the address to announce. CannotListen
    says why in words."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # SO_REUSEADDR (as uvicorn would): a restart binds while the last run's
        # connections are still in TIME_WAIT.
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as exc:
        code = exc.errno or 0
        if isinstance(exc, socket.gaierror) or code < 0:  # EAI_*: the name, not the bind
            reason = "unknown host; choose --host"
        else:
            reason = LISTEN_FAILURES.get(code, exc.strerror or str(exc))
    raise CannotListen(f"cannot listen on {host}:{port}: {reason}", errno=code)


def bound_port(sock: socket.socket) -> int:
    """The port ``sock`` listens on (the one chosen when 0 was asked for)."""
    port: int = sock.getsockname()[1]
    return port
