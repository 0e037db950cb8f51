"""Pause, reclaim and pack for container sandboxes: what the Backend interface asks of
them, in cgroup and overlay terms.

- **Pause** is the cgroup freezer (~0.2 ms whatever the sandbox's size), on the event
  loop so that no request sees a frozen sandbox as running; **reclaim** then pushes its
  memory to swap or drops its page cache (dsec.resources.reclaim), in a thread.
- **Pack** is mkfs.erofs of the overlay upper with the sandbox frozen (a paused sandbox
  stays frozen), leaving out every mount point of the container and the protected
  paths: a container sandbox's changes are exactly its upper (new and modified files,
  whiteouts, opaque directories), which overlayfs honours in a lower layer too.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.backends.base import ReclaimFigures, SandboxRecord
from dsec.images.store import mkfs_erofs
from dsec.resources import prefetch as readahead
from dsec.resources import reclaim as memory
from dsec.resources.cgroups import CgroupHost
from dsec.security import protected

# Never in a packed layer, whatever the container's config says.
ALWAYS_EXCLUDED = ("/.dsec", "/etc/resolv.conf", "/proc", "/sys", "/dev")


def excluded_paths(rec: SandboxRecord, config: dict[str, Any] | None) -> list[str]:
    """Absolute paths left out of a packed layer: platform mounts and protected paths."""
    paths = set(ALWAYS_EXCLUDED)
    for mount in (config or {}).get("mounts", []):
        dest = mount.get("destination") if isinstance(mount, dict) else None
        if isinstance(dest, str) and dest.startswith("/") and dest.rstrip("/"):
            paths.add(os.path.normpath(dest))
    paths.update(os.path.normpath(m.path) for m in rec.spec.protected)
    # A parent already excluded covers its children.
    out: list[str] = []
    for p in sorted(paths):
        if not any(p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _count(upper: Path, excluded: list[str]) -> int:
    skip = {os.path.join(str(upper), p.lstrip("/")) for p in excluded}
    n = 0
    for dirpath, dirs, files in os.walk(upper):
        dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skip]
        n += len(dirs) + sum(1 for f in files if os.path.join(dirpath, f) not in skip)
    return n


def pause(host: CgroupHost, rel: str) -> None:
    protected.freeze(host, rel, timeout=2.0)


async def _measured(
    host: CgroupHost, rel: str, step: Callable[[], tuple[int | None, int | None]]
) -> ReclaimFigures:
    """Run one reclaim ``step`` (in a thread: it blocks in the kernel) and say what it
    gave back, anonymous memory and swap included."""
    anon_before = memory.anon_bytes(host, rel)
    before, after = await asyncio.to_thread(step)
    return ReclaimFigures(
        before=before,
        after=after,
        anon_before=anon_before,
        anon_after=memory.anon_bytes(host, rel),
        swap=memory.swap_bytes(host, rel),
    )


async def reclaim(host: CgroupHost, rel: str, *, swap: bool) -> ReclaimFigures:
    return await _measured(host, rel, lambda: memory.reclaim(host, rel, swap=swap))


async def reclaim_idle(host: CgroupHost, rel: str, *, anon: bool) -> ReclaimFigures:
    return await _measured(host, rel, lambda: memory.reclaim_idle(host, rel, anon=anon))


async def prefetch(
    host: CgroupHost, rel: str, *, swapped: tuple[int, int | None] = (0, None)
) -> int:
    """MADV_WILLNEED over the processes of the (thawed) sandbox (dsec.resources.prefetch)."""
    done = await asyncio.to_thread(
        lambda: readahead.prefetch(sorted(host.pids(rel)), swapped=swapped)
    )
    return done.advised_bytes


def settle_swappiness(host: CgroupHost, rel: str) -> None:
    memory.inherit_swappiness(host, rel)


def resume(host: CgroupHost, rel: str) -> None:
    protected.thaw(host, rel)


def keep_paused(host: CgroupHost, rel: str) -> bool:
    """After an edge restart: a sandbox recorded as paused with processes left stays
    frozen (and gets back the swappiness a crash mid-reclaim left raised)."""
    if not host.pids(rel):
        return False
    if not protected.is_frozen(host, rel):
        protected.freeze(host, rel, timeout=2.0)
    memory.inherit_swappiness(host, rel)
    return True


async def pack(
    rec: SandboxRecord,
    host: CgroupHost,
    rel: str,
    upper: Path,
    out: Path,
    *,
    compression: str | None,
    frozen_already: bool,
) -> tuple[int, list[str]]:
    """mkfs.erofs of ``upper`` into ``out`` with the sandbox frozen; (entries, excluded)."""
    try:
        config = json.loads((upper.parent / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    excluded = excluded_paths(rec, config)
    if not frozen_already:
        await asyncio.to_thread(protected.freeze, host, rel)
    try:
        await mkfs_erofs(out, upper, compression=compression, exclude=excluded)
        files = await asyncio.to_thread(_count, upper, excluded)
    finally:
        if not frozen_already:
            await asyncio.shield(asyncio.to_thread(protected.thaw, host, rel))
    return files, excluded
