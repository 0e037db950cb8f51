"""The host's dsec-lazyfs process: start it, find it again after a restart, stop it.

One daemon per images directory serves every lazily loaded layer of the host at
``<lazy>/fuse/<hex>``. It runs in its own session so that, like the sandboxes, it
survives the platform being killed: a restarted platform adopts it (same pid, same
store, mount still alive) instead of breaking the layers running sandboxes read from.
A daemon that cannot be adopted is killed and its mounts are detached, so none leaks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal
import time
from pathlib import Path

from dsec import linux
from dsec.errors import BackendError
from dsec.images.lazy.build import lazyfs_binary

log = logging.getLogger(__name__)

FSTYPE = "fuse.dsec-lazyfs"
READY_TIMEOUT = 10.0
# Scheduling priority of the daemon's workers: a little ahead of the sandboxes, whose
# cold reads wait on it (see dsec-lazyfs.c); it needs little CPU, so nothing starves.
NICE = -5
# A layer just unmounted can keep its FUSE file open for a moment: the overlay of a
# sandbox that just stopped is dropped with its mount namespace, after the sandbox is
# gone (seen under load: the daemon's unmount failed with EBUSY and it was left behind).
UNMOUNT_BUSY_WAIT = 3.0


class LazyDaemon:
    def __init__(
        self,
        root: Path,
        source: str,
        token: str | None,
        *,
        threads: int = 16,
        timeout: int = 10,
        readahead: int = 128 * 1024,
        nice: int = NICE,
        blob_prefix: str = "/v1/blobs/",
        ca_file: Path | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self.mount_dir = self.root / "fuse"
        self.cache_dir = self.root / "cache"
        self.state_file = self.root / "daemon.json"
        self.log_path = self.root / "daemon.log"
        # The Authorization header the daemon sends, in the 0700 root-only lazy dir
        # (never under a sandbox's reach); re-read by the daemon on a 401.
        self.auth_file = self.root / "store-auth"
        self.source = source
        self.token = token
        # The whole Authorization header value; set from the store before start
        # (RemoteStore.lazy_authorization). A bare token is a bearer token.
        self.authorization: str | None = f"Bearer {token}" if token else None
        self.blob_prefix = blob_prefix
        self.ca_file = ca_file  # https:// stores: trust only these CAs (else the system's)
        self.threads = threads
        self.timeout = timeout
        self.readahead = readahead
        self.nice = nice
        self.pid: int | None = None

    def path(self, digest_hex: str) -> Path:
        return self.mount_dir / digest_hex

    # -- lifecycle (blocking; call from a thread) --

    def start(self) -> bool:
        """Adopt a running daemon of an earlier run or start one; True if adopted."""
        for d in (self.root, self.mount_dir, self.cache_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        pid = self._adoptable()
        if pid is not None:
            self.pid = pid
            if self.authorization:  # an earlier run's token may be stale: the daemon
                self.set_authorization(self.authorization)  # re-reads it on a 401
            log.info("adopted dsec-lazyfs (pid %d) serving %s", pid, self.mount_dir)
            return True
        self.cleanup_stale()
        self._spawn()
        return False

    def set_authorization(self, value: str) -> None:
        """Hand the daemon a new Authorization header (a renewed token): written next
        to the file and renamed over it, so the daemon never reads half of one."""
        self.authorization = value
        tmp = self.auth_file.with_name(f".{self.auth_file.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, value.encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.auth_file)

    def alive(self) -> bool:
        return self.pid is not None and linux.pid_alive(self.pid) and self.mounted()

    def mounted(self) -> bool:
        target = str(self.mount_dir.resolve())
        return any(m.mount_point == target and m.fstype == FSTYPE for m in linux.mounts(target))

    def stop(self, timeout: float = 5.0) -> None:
        """Unmount and wait for the daemon to exit (layers on it must be unmounted first)."""
        deadline = time.monotonic() + UNMOUNT_BUSY_WAIT
        while True:
            try:
                linux.umount(self.mount_dir)
                break
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                raise BackendError(f"cannot unmount {self.mount_dir}: {exc.strerror}") from exc
        pid, self.pid = self.pid, None
        if pid is not None:
            _wait_exit(pid, timeout)
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()

    def cleanup_stale(self) -> None:
        """Detach what a dead or foreign daemon left: EROFS mounts on its files, its
        FUSE mount, and the process itself."""
        prefix = str(self.mount_dir.resolve()) + "/"
        for entry in linux.mounts():
            if entry.fstype == "erofs" and entry.source.startswith(prefix):
                log.warning("detaching layer %s: its lazy daemon is gone", entry.mount_point)
                linux.umount(entry.mount_point, detach=True)
        for entry in reversed(linux.mounts(self.mount_dir)):
            linux.umount(entry.mount_point, detach=True)
        state = self._state()
        pid = state.get("pid") if state else None
        if isinstance(pid, int) and _is_lazyfs(pid, self.mount_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 2.0)
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()

    def stats(self) -> dict[str, int]:
        """The daemon's counters (bytes fetched, verified, served ...)."""
        out: dict[str, int] = {}
        try:
            text = (self.mount_dir / ".stats").read_text()
        except OSError:
            return out
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
        return out

    # -- internals --

    def _state(self) -> dict[str, object] | None:
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def _adoptable(self) -> int | None:
        state = self._state()
        if state is None or state.get("source") != self.source:
            return None
        pid = state.get("pid")
        if not isinstance(pid, int) or not _is_lazyfs(pid, self.mount_dir):
            return None
        return pid if self.mounted() else None

    def _spawn(self) -> None:
        binary = lazyfs_binary()
        args = [
            str(binary),
            "--mount",
            str(self.mount_dir),
            "--cache",
            str(self.cache_dir),
            "--store",
            self.source,
            "--threads",
            str(self.threads),
            "--timeout",
            str(self.timeout),
            "--readahead",
            str(self.readahead),
            "--ready-fd",
            "3",
            "--nice",
            str(self.nice),
        ]
        if self.source.startswith("http") and self.blob_prefix != "/v1/blobs/":
            args += ["--blob-prefix", self.blob_prefix]
        if self.authorization:
            self.set_authorization(self.authorization)
            args += ["--auth-file", str(self.auth_file)]
        if self.source.startswith("https://") and self.ca_file is not None:
            args += ["--ca-file", str(self.ca_file)]
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        logfd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            pid = os.posix_spawn(
                args[0],
                args,
                {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, logfd, 1),
                    (os.POSIX_SPAWN_DUP2, logfd, 2),
                    (os.POSIX_SPAWN_DUP2, wfd, 3),
                ],
                setsid=True,
            )
        finally:
            os.close(wfd)
            os.close(logfd)
        try:
            ready, _, _ = select.select([rfd], [], [], READY_TIMEOUT)
            line = os.read(rfd, 256).decode(errors="replace") if ready else ""
        finally:
            os.close(rfd)
        if not line.startswith("ready"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 2.0)
            tail = self.log_path.read_text(errors="replace")[-1500:]
            raise BackendError(f"dsec-lazyfs did not start: {tail.strip() or 'no output'}")
        self.pid = pid
        doc = {"pid": pid, "source": self.source, "binary": str(binary), "started": time.time()}
        self.state_file.write_text(json.dumps(doc))
        log.info(
            "started dsec-lazyfs (pid %d) serving %s from %s", pid, self.mount_dir, self.source
        )


def _is_lazyfs(pid: int, mount_dir: Path) -> bool:
    """Is ``pid`` a live dsec-lazyfs serving ``mount_dir`` (not a recycled pid)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return (
        linux.pid_alive(pid)
        and bool(argv)
        and os.path.basename(argv[0]).startswith(b"dsec-lazyfs")
        and os.fsencode(str(mount_dir)) in argv
    )


def _wait_exit(pid: int, timeout: float) -> None:
    """Wait for ``pid`` to end (reaping it if it is our child); SIGKILL after timeout."""
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:
            if not linux.pid_alive(pid):
                return
        if time.monotonic() > deadline and not killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed = True
            deadline = time.monotonic() + 2.0
        elif time.monotonic() > deadline:
            log.warning("dsec-lazyfs pid %d did not exit", pid)
            return
        time.sleep(0.01)
