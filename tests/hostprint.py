"""What a successful attack on the host would change, taken before and after.

One place decides what counts as the host's own state, so the adversarial, seccomp,
job and density tests agree. Platforms' own pause swaps (``dsec.resources.swap``) are
left out: every ``dsec up`` on the host, e.g. another test's, turns one on and off,
and their ``Used`` column moves with any sandbox's paging.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.resources import swap


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def operator_swap_areas() -> set[tuple[str, int]]:
    """The host's own active swap areas by name and size (``Used`` moves under the
    host's own load, so it is not part of the print)."""
    return {(s.filename, s.size_bytes) for s in swap.operator_swaps()}


@dataclass(frozen=True)
class HostPrint:
    """What a successful attack on the host would change."""

    clock_offset: float
    modules: str
    swaps: frozenset[tuple[str, int]]
    hostname: str
    keys: int

    @classmethod
    def take(cls) -> HostPrint:
        return cls(
            clock_offset=time.time() - time.monotonic(),
            modules=_read("/proc/modules"),  # absent on kernels built without modules
            swaps=frozenset(operator_swap_areas()),
            hostname=socket.gethostname(),
            # crun gives each container a session keyring; count only what attacks name.
            keys=sum("dsec" in line for line in _read("/proc/keys").splitlines()),
        )

    def assert_same(self, other: HostPrint) -> None:
        assert abs(self.clock_offset - other.clock_offset) < 2.0, "host clock changed"
        assert self.modules == other.modules, "kernel modules changed"
        assert self.swaps == other.swaps, "swap changed"
        assert self.hostname == other.hostname, "host name changed"
        assert self.keys == other.keys, "host keyring changed"
