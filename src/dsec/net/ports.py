"""A free TCP port for a server that another process will bind a moment later.

The usual trick, ``bind(("127.0.0.1", 0))`` and close, hands out a port from the
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


def free_port(host: str = "127.0.0.1", *, slot: int = 0, slots: int = 1) -> int:
    """A port on ``host`` that nothing is bound to now and that no outgoing connection
    will take before the caller's server binds it (see the module's docstring).

    Raises OSError(EADDRINUSE) if every candidate is taken."""
    ports = candidate_ports(slot, slots)
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        with socket.socket() as sock:
            try:
                # No SO_REUSEADDR: a port still in TIME_WAIT is skipped as well, since
                # a server without that option could not bind it either.
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(errno.EADDRINUSE, f"no free port on {host} outside the ephemeral range")
