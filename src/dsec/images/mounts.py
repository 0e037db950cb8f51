"""Host mount cache: each layer is mounted read-only once per host and shared.

Every sandbox on the host that uses a layer stacks its overlay on the same EROFS mount,
so the layer's pages sit in the page cache once. The kernel mounts EROFS straight from
the blob file (no loop device), ~0.06 ms, through the syscall rather than mount(8).

Mount points are ``<root>/mnt/sha256/<hex>``. After a crash or restart
:meth:`LayerMounts.adopt_existing` finds them again in /proc/self/mountinfo so they are
reused, not mounted twice. Recovery order for an edge: ``adopt_existing()``, then
``acquire()`` once per layer of every sandbox it re-adopts, then ``unmount_unused()``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sysconfig
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dsec import linux
from dsec.errors import BackendError, CorruptBlob
from dsec.images.store import HEX_RE, LayerStore, digest_hex, normalize_digest
from dsec.threads import acquire_in_thread

log = logging.getLogger(__name__)

# nosuid/nodev only guard the host-side path: overlays stacked on the mount are not
# affected by them (checked: a setuid binary and /dev/null work through the overlay).
MOUNT_FLAGS = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV

CLOSE_BUSY_SECONDS = 2.0
"""How long a close waits for an unused layer that is still busy before detaching it."""

TRACE_USERS_ENV = "DSEC_TRACE_LAYER_USERS"
"""Set to 1 (the tests do): every acquire and release is counted by its holder (a
sandbox id, where the caller names one) or else by its call site, and a close that
finds a layer still counted as used names the holders (with where they acquired) and
sites that took more than they gave back. Off in production: a stack walk per acquire."""
HELD_BY = "held by "


_LIBRARIES = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])


def _ours(filename: str) -> bool:
    return filename != __file__ and (
        f"{os.sep}dsec{os.sep}" in filename or not filename.startswith(_LIBRARIES)
    )


def _call_site() -> str:
    """Where a user is: the innermost frames of our code (dsec's or a test's, not this
    module's, the standard library's or another package's), innermost first."""
    frames = [
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if _ours(f.filename)
    ]
    return " < ".join(reversed(frames[-6:])) or "?"


# Lazily loaded layers (EROFS on a dsec-lazyfs file): EROFS reads the FUSE file with
# O_DIRECT, so a layer's bytes are cached once (EROFS's page cache), not a second time
# in the FUSE file's (bench_lazy.py: 177 MiB -> 4 MiB of FUSE page cache at the peak of
# the burst, one copy less per byte read cold). The per-file readahead of the mount
# may grow to LAZY_READAHEAD_KB for sequential reads: the kernel's readahead knows file
# boundaries, so a large file read front to back reaches dsec-lazyfs as a few large
# requests (one range request each) without fetching past the file's end.
LAZY_MOUNT_DATA = "directio"
LAZY_READAHEAD_KB = 1024
BDI_DIR = Path("/sys/class/bdi")


class LayerSource(Protocol):
    """Where layer bytes come from (dsec.images.hostlayers.HostLayers: local blob, lazy
    FUSE file, or an eager fetch from the shared store)."""

    def source(self, digest: str) -> Path: ...

    def keep_mount(self, digest: str, source: str) -> bool: ...

    def is_lazy(self, digest: str) -> bool: ...

    async def prepare(self, digests: list[str], loading: str) -> None: ...

    def enforce_budget(self) -> list[str]: ...

    @property
    def over_budget(self) -> bool:
        """The last enforce_budget() left the cache over its budget."""
        ...

    def acquired(self, digest: str) -> None: ...


class LayerMounts:
    """Refcounted read-only mounts of verified layer blobs.

    ``root`` is the images directory (blobs under ``root/blobs``, mounts under
    ``root/mnt``). Methods are synchronous and sub-millisecond once a blob is verified;
    a lock makes them safe to call from worker threads too.
    """

    def __init__(
        self, root: Path, store: LayerStore | None = None, provider: LayerSource | None = None
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self.store = store if store is not None else LayerStore(self.root)
        self.provider = provider
        self.mnt_dir = self.root / "mnt" / "sha256"
        self._refs: dict[str, int] = {}  # digest -> users; present == mounted by us
        self._lock = threading.Lock()
        # digest -> holder or call site -> acquires minus releases (TRACE_USERS_ENV)
        self._sites: dict[str, Counter[str]] | None = (
            {} if os.environ.get(TRACE_USERS_ENV) == "1" else None
        )
        self._acquired_at: dict[tuple[str, str], str] = {}  # (digest, holder) -> site
        self._dirs_ready = False

    def mount_point(self, digest: str) -> Path:
        return self.mnt_dir / digest_hex(digest)

    async def prepare(self, digests: Sequence[str], loading: str = "lazy") -> None:
        """Make layers mountable before :meth:`acquire` (fetching them if they are not
        on this host: whole for ``eager``, only their index for ``lazy``)."""
        if self.provider is not None:
            await self.provider.prepare(list(digests), loading)

    def is_lazy(self, digest: str) -> bool:
        """Lazily loaded layers are read on demand, never prewarmed."""
        return self.provider is not None and self.provider.is_lazy(digest)

    def acquire(self, digest: str, *, holder: str | None = None) -> Path:
        """Mount the layer if needed, count one more user, return its mount point.

        The blob is verified first (cheap when unchanged since its last check), so a
        corrupt blob raises CorruptBlob and is never mounted. ``holder`` (the sandbox
        that uses it; the same on its :meth:`release`) names a user that never lets go
        in the trace (TRACE_USERS_ENV); the count does not depend on it.
        """
        digest = normalize_digest(digest)
        if self.provider is not None:
            self.provider.acquired(digest)
        with self._lock:
            if digest in self._refs:
                self._refs[digest] += 1
                self._trace(digest, +1, holder)
                return self.mount_point(digest)
        # Outside the lock: may hash the whole blob.
        blob = self.provider.source(digest) if self.provider else self.store.verify(digest)
        with self._lock:
            target = self.mount_point(digest)
            if digest not in self._refs:
                self._mount(blob, target, lazy=self.is_lazy(digest))
                self._refs[digest] = 0
            self._refs[digest] += 1
            self._trace(digest, +1, holder)
            return target

    async def acquire_async(self, digest: str, *, holder: str | None = None) -> Path:
        """:meth:`acquire` in a worker thread (the first one may hash a whole blob). If
        the caller is cancelled meanwhile, the mount made for it is released, not left
        counted for a user that never learnt of it (dsec.threads)."""
        return await acquire_in_thread(
            functools.partial(self.acquire, digest, holder=holder),
            lambda _mount: self.release(digest, holder=holder),
        )

    def blob(self, digest: str) -> Path:
        """The file a layer's bytes are read from: the verified local blob, or for a
        lazily loaded layer its dsec-lazyfs file (chunks fetched on first read). A VM
        attaches it as a read-only disk, so containers and microVMs share one copy of
        the layer, one chunk cache and one eviction policy. Call after :meth:`acquire`,
        which verifies the blob and counts the user that keeps it from eviction."""
        digest = normalize_digest(digest)
        return self.provider.source(digest) if self.provider else self.store.path(digest)

    def release(self, digest: str, *, holder: str | None = None) -> None:
        """One user fewer (``holder``: as given to its :meth:`acquire`). The mount
        stays cached until :meth:`unmount_unused`."""
        digest = normalize_digest(digest)
        with self._lock:
            count = self._refs.get(digest)
            if count is None:
                log.warning("release of layer %s that is not mounted", digest)
                return
            if count == 0:
                log.warning("release of layer %s with no users", digest)
                return
            self._refs[digest] = count - 1
            self._trace(digest, -1, holder)
        if self.provider is not None and (count == 1 or self.provider.over_budget):
            # A layer just became unused: the cache may have grown past its budget. Or
            # the cache is over it and this user was one that let go (a warm sandbox:
            # dsec.images.service.LayerCacheBudget), so the rest may be others that can.
            self.provider.enforce_budget()

    def release_held(self, held: list[str], *, holder: str) -> None:
        """Release every layer in ``held`` (a sandbox's own list of what it holds) and
        empty that list in place, so a second call releases nothing: for teardowns,
        which are idempotent and call this in a ``finally`` (a step that fails, or a
        cancel midway, must not leave the layers counted as used)."""
        while held:
            digest = held.pop()
            try:
                self.release(digest, holder=holder)
            except Exception:  # one bad entry must not keep the others held
                log.exception("release of layer %s by %s failed", digest, holder)

    def _trace(self, digest: str, delta: int, holder: str | None) -> None:
        """Count a user by its holder, or else at its call site (under the lock; only
        with TRACE_USERS_ENV)."""
        if self._sites is None:
            return
        if holder is None:
            self._sites.setdefault(digest, Counter())[_call_site()] += delta
            return
        key = HELD_BY + holder
        counts = self._sites.setdefault(digest, Counter())
        counts[key] += delta
        if counts[key] > 0:
            if (digest, holder) not in self._acquired_at:
                self._acquired_at[(digest, holder)] = _call_site()
        elif counts[key] == 0:  # balanced: nothing to report about this holder
            del counts[key]
            self._acquired_at.pop((digest, holder), None)

    def refcount(self, digest: str) -> int:
        with self._lock:
            return self._refs.get(normalize_digest(digest), 0)

    def is_mounted(self, digest: str) -> bool:
        with self._lock:
            return normalize_digest(digest) in self._refs

    def mounted(self) -> dict[str, int]:
        """digest -> number of users, for every layer mounted by this cache."""
        with self._lock:
            return dict(self._refs)

    def adopt_existing(self) -> list[str]:
        """Take over layer mounts left by an earlier run (users unknown: count 0).

        Duplicates stacked on one mount point are unmounted down to one; mounts whose
        blob is gone are unmounted too. Returns the adopted digests.
        """
        self.mnt_dir.mkdir(parents=True, exist_ok=True)
        base = str(self.mnt_dir.resolve())
        seen: dict[str, int] = {}
        sources: dict[str, str] = {}
        for entry in linux.mounts(base):
            name = os.path.basename(entry.mount_point)
            if os.path.dirname(entry.mount_point) != base or not HEX_RE.match(name):
                log.warning("ignoring foreign mount %s under %s", entry.mount_point, base)
                continue
            if entry.fstype != "erofs":
                log.warning("ignoring %s mount at %s", entry.fstype, entry.mount_point)
                continue
            seen[f"sha256:{name}"] = seen.get(f"sha256:{name}", 0) + 1
            sources[f"sha256:{name}"] = entry.source
        adopted: list[str] = []
        with self._lock:
            for digest, count in sorted(seen.items()):
                target = self.mount_point(digest)
                for _ in range(count - 1):
                    linux.umount(target, detach=True)
                if digest in self._refs:
                    continue
                if not self._keep(digest, sources.get(digest, "")):
                    log.warning("unmounting layer %s: its blob is gone", digest)
                    linux.umount(target, detach=True)
                    continue
                self._refs[digest] = 0
                adopted.append(digest)
        if adopted:
            log.info("adopted %d existing layer mounts", len(adopted))
        return adopted

    def unmount_unused(self) -> list[str]:
        """Unmount layers no sandbox uses; returns the digests unmounted."""
        done: list[str] = []
        with self._lock:
            for digest, count in list(self._refs.items()):
                if count > 0:
                    continue
                target = self.mount_point(digest)
                try:
                    linux.umount(target)
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        log.info("layer %s is busy, keeping it mounted", digest)
                        continue
                    raise
                del self._refs[digest]
                with contextlib.suppress(OSError):
                    target.rmdir()
                done.append(digest)
        return done

    def unmount(self, digest: str) -> bool:
        """Unmount one layer if nobody uses it; True if it is no longer mounted."""
        digest = normalize_digest(digest)
        with self._lock:
            count = self._refs.get(digest)
            if count is None:
                return True
            if count > 0:
                return False
            target = self.mount_point(digest)
            try:
                linux.umount(target)
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return False
                raise
            del self._refs[digest]
            with contextlib.suppress(OSError):
                target.rmdir()
            return True

    def _keep(self, digest: str, source: str) -> bool:
        if self.provider is not None:
            return self.provider.keep_mount(digest, source)
        return self.store.exists(digest)

    def close(
        self, *, nothing_live: bool = False, busy_seconds: float = CLOSE_BUSY_SECONDS
    ) -> None:
        """Unmount everything unused; layers still in use stay for the next run to adopt.

        A layer whose last user has just gone can still be busy for a moment (a reader
        the kernel is letting go of): it is tried again for up to ``busy_seconds``, then
        detached (gone from the host's mount table; the kernel frees it once its last
        reader ends), so a shutdown never leaves a mount behind for that. With
        ``nothing_live`` (no sandbox outlives this process) a layer still counted as used
        is a user that never let go: it is named in the log and unmounted as well.
        """
        if nothing_live:
            with self._lock:
                held = {d: n for d, n in self._refs.items() if n > 0}
                for digest in held:
                    self._refs[digest] = 0
            if held:
                log.warning("layers still counted as used with no sandbox left: %s", held)
                for digest in held:
                    self._log_sites(digest)
        deadline = time.monotonic() + busy_seconds
        while True:
            self.unmount_unused()
            busy = [d for d, n in self.mounted().items() if n == 0]
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        with self._lock:
            for digest in busy:
                if self._refs.get(digest) != 0:
                    continue
                try:
                    linux.umount(self.mount_point(digest), detach=True)
                except OSError as exc:
                    log.warning("layer %s still busy at close, not detached: %s", digest, exc)
                    continue
                log.warning("layer %s still busy at close: detached", digest)
                del self._refs[digest]
                with contextlib.suppress(OSError):
                    self.mount_point(digest).rmdir()

    def _log_sites(self, digest: str) -> None:
        """With TRACE_USERS_ENV: the holders and sites whose acquires and releases of
        ``digest`` do not balance (a release without a holder is counted where it
        happens: look for the pair)."""
        if self._sites is None:
            return
        for key, n in (self._sites.get(digest) or Counter()).items():
            if not n:
                continue
            if key.startswith(HELD_BY):
                where = self._acquired_at.get((digest, key.removeprefix(HELD_BY)))
                log.warning("layer %s: %+d %s (acquired at %s)", digest, n, key, where)
            else:
                log.warning("layer %s: %+d at %s", digest, n, key)

    def _mount(self, blob: Path, target: Path, *, lazy: bool = False) -> None:
        if not self._dirs_ready:
            # Only root walks into layer mounts from the host side.
            self.mnt_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.mnt_dir.parent, 0o700)
            self._dirs_ready = True
        target.mkdir(mode=0o755, exist_ok=True)
        try:
            if lazy:
                _mount_lazy(blob, target)
            else:
                linux.mount(blob, target, "erofs", MOUNT_FLAGS)
        except OSError as exc:
            with contextlib.suppress(OSError):
                target.rmdir()
            if exc.errno == errno.EIO:
                raise CorruptBlob(
                    f"cannot mount layer {blob.name}: reading it failed (a chunk that does not "
                    "match its digest, or the layer store is unreachable, refuses the "
                    "credentials or has an untrusted TLS certificate: images/lazy/daemon.log "
                    "says which); it is not mounted",
                    digest=f"sha256:{blob.name}",
                ) from exc
            raise BackendError(
                f"cannot mount layer {blob.name} on {target}: {exc.strerror}; the kernel "
                "needs EROFS with file-backed mounts (Linux >= 6.12)",
                errno=exc.errno,
            ) from exc


def _erofs_bdis() -> set[str]:
    try:
        return {name for name in os.listdir(BDI_DIR) if name.startswith("erofs-")}
    except OSError:
        return set()


def _mount_lazy(blob: Path, target: Path) -> None:
    """Mount EROFS from a dsec-lazyfs file: direct reads of the FUSE file (no second
    page cache copy) and a larger readahead window (see LAZY_MOUNT_DATA). Falls back to
    a plain mount on kernels without the ``directio`` option."""
    before = _erofs_bdis()
    try:
        linux.mount(blob, target, "erofs", MOUNT_FLAGS, LAZY_MOUNT_DATA)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        linux.mount(blob, target, "erofs", MOUNT_FLAGS)
    # A file-backed EROFS mount has a backing_dev_info of its own, named erofs-<n>; the
    # kernel does not say which, so take the one this mount added (skipped if another
    # mount raced with ours: only the readahead size is at stake).
    new = _erofs_bdis() - before
    if len(new) == 1:
        with contextlib.suppress(OSError):
            (BDI_DIR / new.pop() / "read_ahead_kb").write_text(str(LAZY_READAHEAD_KB))
