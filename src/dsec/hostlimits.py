"""Host limits checked once at start: refuse or adapt, with one line that says so.

Found by running under hostile limits: a hard ``nofile`` below the 4096 every sandbox
asks for made every create a 500 while health said ok, and a soft limit left at a
distro's 1024 ran the platform out of fds after a few hundred connections. So at start:

* the soft ``nofile`` is raised to the hard limit (what a server is allowed to use);
* below ``MIN_NOFILE`` the platform refuses to start: it could not serve even a few
  sandboxes and their connections;
* the sandboxes' own ``nofile`` (the OCI spec's rlimit) is lowered to what the host
  allows (crun cannot raise a limit above the hard limit it inherited);
* a data dir with less than ``MIN_FREE_BYTES`` free, or a host ``pid_max`` /
  ``threads-max`` too low to run a sandbox, refuses with what to do.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import DSecError

log = logging.getLogger(__name__)

MiB = 1024 * 1024
SANDBOX_NOFILE = 4096  # what each sandbox gets by default (dsec.backends.container.oci_spec)
MIN_NOFILE = 256  # below this the platform cannot serve a handful of sandboxes
MIN_FREE_BYTES = 64 * MiB
MIN_PIDS = 1024


class HostLimitError(DSecError):
    """The host cannot run the platform as configured; the message says what to do
    (``dsec up`` prints it as its one line and exits)."""

    code = "host_limits"
    status = 503


@dataclass(frozen=True)
class HostLimits:
    nofile_soft: int
    nofile_hard: int
    sandbox_nofile: int  # the rlimit each sandbox gets
    free_bytes: int
    pid_max: int


def _int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_host(data_dir: Path) -> HostLimits:
    """Adapt to the host's limits, or raise HostLimitError with one line."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if limit < MIN_NOFILE:
        raise HostLimitError(
            f"the hard nofile limit is {limit}, below the {MIN_NOFILE} the platform needs: "
            f"raise it (`ulimit -Hn {SANDBOX_NOFILE * 4}` or LimitNOFILE= in the unit)"
        )
    sandbox = min(SANDBOX_NOFILE, limit)
    if sandbox < SANDBOX_NOFILE:
        log.warning(
            "hard nofile is %d: sandboxes get nofile %d instead of %d (raise `ulimit -Hn`)",
            limit,
            sandbox,
            SANDBOX_NOFILE,
        )
    st = os.statvfs(data_dir)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise HostLimitError(
            f"only {free // MiB} MiB free on {data_dir} (at least {MIN_FREE_BYTES // MiB} MiB "
            "needed): free space there or use another --data-dir"
        )
    known = [
        v for v in (_int("/proc/sys/kernel/pid_max"), _int("/proc/sys/kernel/threads-max")) if v
    ]
    pid_max = min(known) if known else 1 << 22
    if pid_max < MIN_PIDS:
        raise HostLimitError(
            f"the host allows only {pid_max} processes (kernel.pid_max/threads-max): "
            f"raise it to at least {MIN_PIDS} (sysctl kernel.pid_max)"
        )
    return HostLimits(soft, hard, sandbox, free, pid_max)


def sandbox_nofile() -> int:
    """The ``nofile`` a sandbox can be given: the default, at most the hard limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return SANDBOX_NOFILE if hard == resource.RLIM_INFINITY else min(SANDBOX_NOFILE, hard)
