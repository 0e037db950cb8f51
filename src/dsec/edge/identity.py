"""One edge per host identity: the edge id a data dir runs as, and the locks that keep
a second instance from sharing it.

Everything an edge owns on the host is named after its data dir or its edge id: the
databases, the runtime state and the spawner socket (data dir); the cgroup subtree
``dsec/<edge>``, the nftables table ``dsec_<edge>``, the veth prefix and NFLOG group
(edge id). A second instance on either would start by sweeping what "its" records do
not explain, i.e. kill every sandbox of the first. So before any such step the
platform takes ``flock``s the kernel releases when the process dies, however it dies
(a SIGKILLed platform restarted on the same data dir finds them free):

- ``<data dir>/lock``: the lock file lives in the directory itself, so the same
  directory reached by another path (a symlink, a bind mount) is still one lock;
- ``/run/dsec/edge-<id>.lock``: the edge id, hence the cgroup subtree and the nft table;
- ``/run/dsec/net-<veth prefix>.lock``: two ids whose hashes share a veth prefix.

The locks are taken without blocking: a conflict is refused at once with who holds
it and what to do, and nothing has been touched. Lock fds are close-on-exec, so no
helper that outlives the platform (the spawner) keeps them.

Edge ids default to something unique per host and data dir, and stable across
restarts of that data dir (re-adoption keys on it): derived once from the machine id
and the data dir's real path, then kept in ``<data dir>/edge_id``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import Conflict, InvalidArgument

EDGE_ID_RE = re.compile(r"^[a-z0-9]{1,16}$")  # the edge part of a sandbox id
LEGACY_EDGE_ID = "e0"  # the default before ids were derived per data dir


def lock_dir() -> Path:
    """Host-wide lock directory (a tmpfs: emptied at boot, like the edges it guards)."""
    return Path(os.environ.get("DSEC_LOCK_DIR", "/run/dsec"))


class InstanceConflict(Conflict):
    """Another live platform already uses this data dir, edge id or network identity:
    refused before anything on the host was touched."""

    code = "instance_conflict"


def machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text().strip()
            if text:
                return text
    return os.uname().nodename


def derived_edge_id(data_dir: Path) -> str:
    """``e`` + 11 hex digits of hash(machine id, real path of the data dir)."""
    seed = f"{machine_id()}\0{os.path.realpath(data_dir)}".encode()
    return "e" + hashlib.sha256(seed).hexdigest()[:11]


def check_edge_id(edge_id: str) -> str:
    if not EDGE_ID_RE.match(edge_id):
        raise InvalidArgument(
            f"edge id {edge_id!r} must be 1-16 lowercase letters and digits",
            edge_id=edge_id,
        )
    return edge_id


def resolve_edge_id(data_dir: Path, explicit: str | None) -> str:
    """The edge id this data dir runs as: ``explicit`` (DSEC_EDGE_ID, --edge-id) if
    given; else the one kept in ``<data dir>/edge_id``; else, for a data dir that
    already holds sandbox records from before ids were derived, ``e0`` (so that its
    sandboxes are re-adopted); else a new derived id. Whichever it is is kept, so a
    later start without an explicit id re-adopts the same sandboxes."""
    kept = data_dir / "edge_id"
    if explicit:
        edge_id = check_edge_id(explicit)
    else:
        with contextlib.suppress(FileNotFoundError):
            return check_edge_id(kept.read_text().strip())
        edge_id = LEGACY_EDGE_ID if (data_dir / "edge.db").exists() else derived_edge_id(data_dir)
    with contextlib.suppress(FileNotFoundError):
        if kept.read_text().strip() == edge_id:
            return edge_id
    tmp = kept.with_suffix(".tmp")
    tmp.write_text(edge_id + "\n")
    os.replace(tmp, kept)
    return edge_id


@dataclass
class HostClaim:
    """The locks of one running platform; held until ``release`` (or the process ends)."""

    note: str
    edge_id: str = ""
    fds: list[int] = field(default_factory=list)

    def take(self, path: Path, what: str, fix: str) -> None:
        """One more lock; InstanceConflict (the claim unchanged) if someone holds it."""
        self.fds.append(_take(path, what, self.note, fix))

    def lock_network(self, prefix: str, edge_id: str) -> None:
        """The veth prefix (and NFLOG group) of ``edge_id``'s NetworkManager, which
        two distinct edge ids could share by hash."""
        self.take(
            lock_dir() / f"net-{prefix}.lock",
            f"network prefix {prefix} (veths of edge {edge_id})",
            "give this instance another --edge-id / DSEC_EDGE_ID",
        )

    def release(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _holder(fd: int) -> str:
    """What the current holder wrote into the lock file (its pid, edge and data dir)."""
    with contextlib.suppress(OSError):
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
        if text:
            return text
    return "another process"


def _take(path: Path, what: str, note: str, fix: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise InstanceConflict(
                f"{what} is in use by a running platform ({holder}); {fix}",
                lock=str(path),
                holder=holder,
            ) from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    return fd


def claim_host_identity(data_dir: Path, edge_id: str | None, *, url: str = "") -> HostClaim:
    """Lock the data dir, settle its edge id (``resolve_edge_id``), lock that (cgroup
    subtree, nft table); or raise InstanceConflict having touched nothing on the host
    (locks taken so far are given back). The data dir must exist."""
    run = lock_dir()
    run.mkdir(parents=True, exist_ok=True, mode=0o755)
    where = f"data dir {data_dir}" + (f", {url}" if url else "")
    claim = HostClaim(f"pid {os.getpid()}, {where}")
    try:
        claim.take(
            data_dir / "lock", f"data dir {data_dir}", "stop it first, or use another --data-dir"
        )
        claim.edge_id = resolve_edge_id(data_dir, edge_id)
        claim.note = f"pid {os.getpid()}, edge {claim.edge_id}, {where}"
        claim.take(
            run / f"edge-{claim.edge_id}.lock",
            f"edge id {claim.edge_id!r} (cgroup dsec/{claim.edge_id}, nft table "
            f"dsec_{claim.edge_id})",
            "stop it first, or give this instance another --edge-id / DSEC_EDGE_ID",
        )
    except BaseException:
        claim.release()
        raise
    return claim
