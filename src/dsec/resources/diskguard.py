"""Hold sandboxes' writes to what the host can still back, for a sparse disk image.

The sandboxes' btrfs lives in a *sparse* image file (dsec.resources.disk): the host
allocates its blocks only when btrfs writes them back. When the data dir's file system
fills up, that writeback fails *after* the write inside the sandbox reported success,
btrfs aborts its transaction and goes read-only, and every sandbox gets EIO.
Preallocating the image avoids it but costs every create and stop (opt-in,
``DSEC_SANDBOX_DISK_PREALLOCATE=1``). This guard is the default protection instead:

* every ``interval`` it compares the image's possible growth ``G`` (its size minus the
  bytes the host allocated for it) with the host's free space ``F`` (statvfs of the
  image's directory): while ``F >= G + reserve`` the host can back every write and
  nothing happens (one ``stat`` and one ``statvfs`` a tick);
* below that it *clamps*: each live sandbox's quota group limit becomes its current
  usage plus a fair share of ``F - reserve``, divided by ``COW_FACTOR`` for btrfs's
  copy-on-write and metadata, never above its own configured limit. btrfs reserves
  quota at ``write()`` time, so a write past the share fails inside the sandbox with
  EDQUOT ("Disk quota exceeded") instead of failing the writeback later for everyone;
  the ``reserve`` absorbs what was already in flight between two ticks;
* once ``F >= G + reserve + slack`` again (hysteresis, so limits do not flap) the
  configured limits come back.

Creates pay one dict update (:meth:`HostSpaceGuard.admit`); one made while clamped
gets a clamped limit too. Being clamped alone does not refuse creates (a big image can
be clamped with plenty of room left); a create is refused with 507 when a new
sandbox's share would be below ``MIN_SHARE`` (:meth:`HostSpaceGuard.check_room`), and,
as before, once the data dir itself is nearly full (dsec.exhaustion.MIN_FREE_BYTES).
``/v1/health`` shows the clamp as a ``sandbox_disk`` degradation
(:attr:`HostSpaceGuard.reason`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import InsufficientStorage

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_RESERVE = 512 * MiB
RESERVE_FRACTION = 50  # reserve = max(MIN_RESERVE, image size / RESERVE_FRACTION)
# Host bytes a sandbox's write may cost per byte charged to its quota group: btrfs
# writes data copy-on-write and adds metadata (and a freed block is not free on the
# host until it is discarded).
COW_FACTOR = 2
INTERVAL = 0.5
# While clamped, a create is refused (507) when a new sandbox's share would be below
# this: it would fail half-way (its own directories need quota) or get a useless disk.
MIN_SHARE = 16 * MiB


def reserve_for(image_size: int) -> int:
    """Host bytes kept free below every share: writes already in flight land there."""
    return max(MIN_RESERVE, image_size // RESERVE_FRACTION)


def slack_for(reserve: int) -> int:
    """How far above the clamp threshold the host must be before limits come back."""
    return max(64 * MiB, reserve // 4)


@dataclass(frozen=True)
class HostSpace:
    """One look at the host: what the image could still grow, and what is free."""

    growth: int  # G: image size minus the bytes the host allocated for it
    free: int  # F: bytes available to us on the image's file system
    reserve: int

    @property
    def short(self) -> bool:
        """The host could not back every block of the image."""
        return self.free < self.growth + self.reserve

    def recovered(self) -> bool:
        """Enough room again, with hysteresis, to hand back the configured limits."""
        return self.free >= self.growth + self.reserve + slack_for(self.reserve)

    @property
    def budget(self) -> int:
        """Host bytes the clamped sandboxes may still take between them."""
        return max(0, self.free - self.reserve)


def share(budget: int, sandboxes: int, *, cow: int = COW_FACTOR) -> int:
    """Bytes of quota one of ``sandboxes`` may still write out of ``budget``."""
    return budget // (cow * max(1, sandboxes))


def clamped_limits(
    budget: int, sandboxes: Mapping[str, tuple[int, int]], *, cow: int = COW_FACTOR
) -> dict[str, int]:
    """Each sandbox's (used, configured) bytes to the limit it gets while clamped:
    used plus its share of ``budget``, at most its configured limit (0 = none)."""
    each = share(budget, len(sandboxes), cow=cow)
    out: dict[str, int] = {}
    for key, (used, configured) in sandboxes.items():
        limit = used + each
        out[key] = min(limit, configured) if configured > 0 else limit
    return out


def measure(image: Path) -> HostSpace:
    """The image's possible growth and the host's free space, now."""
    st = os.stat(image)
    vfs = os.statvfs(image.parent)
    return HostSpace(
        growth=max(0, st.st_size - st.st_blocks * 512),
        free=vfs.f_bavail * vfs.f_frsize,
        reserve=reserve_for(st.st_size),
    )


@dataclass
class _Tracked:
    qgroup: int
    configured: int
    applied: int  # the limit the kernel has now
    failing: bool = False  # the last attempt to change it failed (logged once)


# (path, qgroup, limit bytes) -> None: sets a quota group limit (SandboxDisk.set_limit).
SetLimit = Callable[[Path, int, int], None]
# qgroup -> bytes charged to it now, or None if it is gone.
ReadUsed = Callable[[int], int | None]


class HostSpaceGuard:
    """Clamps live sandboxes' quota limits while the host cannot back the image.

    Thread-safe: creates and teardowns (event loop and worker threads) call
    :meth:`admit` and :meth:`forget`, the edge's supervisor runs :meth:`run`.
    """

    def __init__(
        self,
        image: Path,
        *,
        set_limit: SetLimit,
        read_used: ReadUsed,
        interval: float = INTERVAL,
        look: Callable[[Path], HostSpace] = measure,
    ) -> None:
        self.image = image
        self.interval = interval
        self._look = look
        self._set_limit = set_limit
        self._read_used = read_used
        self._lock = threading.Lock()
        self._live: dict[str, _Tracked] = {}
        self._clamped: HostSpace | None = None  # the look that clamped, None: not clamped

    # -- the create / stop path: a dict update -------------------------------------------
    def check_room(self) -> None:
        """Refuse a new sandbox (InsufficientStorage, 507) while clamped so tight that
        its share would be below MIN_SHARE."""
        space = self._clamped
        if space is None:
            return
        with self._lock:
            each = share(space.budget, len(self._live) + 1)
        if each < MIN_SHARE:
            raise InsufficientStorage(
                f"disk exhausted ({self.reason}; a new sandbox would get "
                f"{each // MiB} MiB): free space on {self.image.parent}; creates resume "
                "by themselves",
                resource="disk",
            )

    def admit(self, path: Path, qgroup: int, configured: int) -> int:
        """Track a new (or re-adopted) sandbox directory; the limit to give it now."""
        with self._lock:
            limit = configured
            if self._clamped is not None:
                each = share(self._clamped.budget, len(self._live) + 1)
                limit = min(configured, each) if configured > 0 else each
            self._live[str(path)] = _Tracked(qgroup, configured, limit)
            return limit

    def forget(self, path: Path) -> None:
        with self._lock:
            self._live.pop(str(path), None)

    # -- state -------------------------------------------------------------------------
    @property
    def clamped(self) -> bool:
        return self._clamped is not None

    @property
    def reason(self) -> str | None:
        """Why sandboxes' disks are clamped (for /v1/health), None while they are not."""
        space = self._clamped
        if space is None:
            return None
        return (
            f"{space.free // MiB} MiB free on {self.image.parent} but the sandbox disk "
            f"image could grow {space.growth // MiB} MiB more: sandboxes' writable disks "
            "are limited to a share of the free space (writes past it fail with EDQUOT)"
        )

    def limits(self) -> dict[str, int]:
        """The limit each tracked sandbox directory has now (tests, diagnostics)."""
        with self._lock:
            return {path: t.applied for path, t in self._live.items()}

    # -- the periodic check ------------------------------------------------------------
    async def run(self) -> None:
        """Check every ``interval`` until cancelled (run by the edge's supervisor)."""
        while True:
            await asyncio.to_thread(self.tick)
            await asyncio.sleep(self.interval)

    def tick(self) -> None:
        """One look at the host; clamp, re-share or restore the limits as it says."""
        space = self._look(self.image)
        if self._clamped is None and not space.short:
            return
        if self._clamped is not None and space.recovered():
            self._restore(space)
            return
        self._clamp(space)

    def _clamp(self, space: HostSpace) -> None:
        with self._lock:
            if self._clamped is None:
                log.warning(
                    "the host cannot back the sandbox disk image (%d MiB free on %s, "
                    "image could grow %d MiB, reserve %d MiB): clamping %d sandboxes' disk "
                    "limits to a share of the free space",
                    space.free // MiB,
                    self.image.parent,
                    space.growth // MiB,
                    space.reserve // MiB,
                    len(self._live),
                )
            self._clamped = space
            live = dict(self._live)
        used: dict[str, tuple[int, int]] = {}
        for path, t in live.items():
            now = self._read_used(t.qgroup)
            if now is not None:
                used[path] = (now, t.configured)
        targets = clamped_limits(space.budget, used)
        loosen = max(MiB, share(space.budget, len(used)) // 4)
        for path, limit in targets.items():
            t = live[path]
            # Tighten at once; loosen only by a margin, not every tick's few bytes.
            if limit < t.applied or limit > t.applied + loosen:
                self._apply(Path(path), t, limit)

    def _restore(self, space: HostSpace) -> None:
        with self._lock:
            self._clamped = None
            live = dict(self._live)
        log.warning(
            "the host can back the sandbox disk image again (%d MiB free on %s): "
            "restoring %d sandboxes' configured disk limits",
            space.free // MiB,
            self.image.parent,
            len(live),
        )
        for path, t in live.items():
            if t.applied != t.configured:
                self._apply(Path(path), t, t.configured)

    def _apply(self, path: Path, t: _Tracked, limit: int) -> None:
        try:
            self._set_limit(path, t.qgroup, limit)
        except FileNotFoundError:
            return  # removed meanwhile: forget() follows
        except OSError as exc:
            # One sandbox's failure must not leave the others unclamped: the next
            # tick tries it again (its applied limit is unchanged).
            if not t.failing:
                log.warning("setting the disk limit of %s to %d MiB: %s", path, limit // MiB, exc)
            t.failing = True
            return
        t.applied = limit
        t.failing = False
