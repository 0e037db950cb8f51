"""Memory reclaim of a frozen sandbox cgroup: push its pages to swap or drop its cache.

What a job pause does to each sandbox after freezing it (paper §6.3: freeze, enable
swap, ``memory.reclaim``): on cgroup v1 ``memory.force_empty`` with a raised
swappiness, on v2 ``memory.reclaim`` with ``swappiness=``. Backend-agnostic cgroup
arithmetic; the container backend calls it (dsec.backends.container.backend), the RL
job control orchestrates it (dsec.rl.jobs).
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from dsec.resources.cgroups import CgroupHost, Layout
from dsec.resources.swap import swap_free_bytes

# A frozen cgroup's swappiness while it is reclaimed (anon and page cache alike).
PAUSE_SWAPPINESS = 100
# Less page cache than this is not worth a reclaim on a swapless host.
MIN_RECLAIM_BYTES = 256 * 1024


def swap_available() -> bool:
    """True if the host has active swap with room left (a device, a file or zram)."""
    return swap_free_bytes() > 0


def _memory_stat(host: CgroupHost, rel: str) -> dict[str, int]:
    rel = rel.strip("/")
    path = (
        host.v1["memory"] / rel / "memory.stat"
        if "memory" in host.v1
        else (host.v2 / rel / "memory.stat" if host.v2 is not None else None)
    )
    out: dict[str, int] = {}
    if path is None:
        return out
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, val = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(val)
    return out


def anon_bytes(host: CgroupHost, rel: str) -> int | None:
    """Anonymous memory charged to the cgroup (v1 total_rss+total_shmem, v2 anon+shmem)."""
    stat = _memory_stat(host, rel)
    if "total_rss" in stat:
        return stat["total_rss"] + stat.get("total_shmem", 0)
    if "anon" in stat:
        return stat["anon"] + stat.get("shmem", 0)
    return None


def swap_bytes(host: CgroupHost, rel: str) -> int | None:
    """The cgroup's memory in swap (v1 total_swap, v2 memory.swap.current)."""
    stat = _memory_stat(host, rel)
    if "total_swap" in stat:
        return stat["total_swap"]
    if host.layout is Layout.V2 and host.v2 is not None:
        with contextlib.suppress(OSError, ValueError):
            return int((host.v2 / rel.strip("/") / "memory.swap.current").read_text())
    return None


def file_bytes(host: CgroupHost, rel: str) -> int:
    """Page cache charged to the cgroup that is not shmem (what reclaim can drop)."""
    stat = _memory_stat(host, rel)
    if "total_inactive_file" in stat:
        return stat["total_inactive_file"] + stat.get("total_active_file", 0)
    return stat.get("file", 0) - stat.get("shmem", 0)


def reclaim(host: CgroupHost, rel: str, *, swap: bool) -> tuple[int | None, int | None]:
    """Push the cgroup's memory out as far as this host allows; (usage before, after).
    Blocking: tens of ms of kernel reclaim when there is something to reclaim.

    Without swap only page cache can go: if there is (almost) none, the reclaim is
    skipped, because the kernel would spend ~25 ms retrying on anonymous pages that
    have nowhere to go (measured: v1 force_empty on a frozen 64 MiB-anon cgroup)."""
    before = host.memory_usage(rel)
    if not swap and file_bytes(host, rel) < MIN_RECLAIM_BYTES:
        return before, before
    rel = rel.strip("/")
    if "memory" in host.v1:
        d = host.v1["memory"] / rel
        old = _raise_swappiness(d) if swap else None
        try:
            # Reclaims page cache, and anon pages where swap exists; gives up (and
            # still returns success) once the kernel makes no progress.
            with contextlib.suppress(OSError):
                (d / "memory.force_empty").write_text("0")
        finally:
            if old is not None:
                with contextlib.suppress(OSError):
                    (d / "memory.swappiness").write_text(old)
    elif host.layout is Layout.V2 and host.v2 is not None and before:
        target = host.v2 / rel / "memory.reclaim"
        try:
            target.write_text(f"{before} swappiness={PAUSE_SWAPPINESS}" if swap else str(before))
        except OSError as exc:
            # EINVAL: a kernel without the swappiness= argument; EAGAIN: less than asked
            # could be reclaimed (expected without swap).
            if swap and exc.errno == errno.EINVAL:
                with contextlib.suppress(OSError):
                    target.write_text(str(before))
    return before, host.memory_usage(rel)


def _raise_swappiness(d: Path) -> str | None:
    """Set PAUSE_SWAPPINESS on a (frozen) v1 cgroup; the old value to put back."""
    try:
        old = (d / "memory.swappiness").read_text().strip()
        if int(old) >= PAUSE_SWAPPINESS:
            return None
        (d / "memory.swappiness").write_text(str(PAUSE_SWAPPINESS))
    except (OSError, ValueError):
        return None
    return old


def inherit_swappiness(host: CgroupHost, rel: str) -> None:
    """v1: a crash in the middle of a reclaim left PAUSE_SWAPPINESS on the sandbox; put
    back its parent's value (0 where the platform keeps sandboxes off swap)."""
    mem = host.v1.get("memory")
    if mem is None:
        return
    d = mem / rel.strip("/")
    with contextlib.suppress(OSError):
        parent = (d.parent / "memory.swappiness").read_text().strip()
        if (d / "memory.swappiness").read_text().strip() != parent:
            (d / "memory.swappiness").write_text(parent)


def cold_bytes(host: CgroupHost, rel: str, *, anon: bool) -> int:
    """Inactive (cold) memory of the cgroup: inactive page cache, and inactive anon
    when ``anon`` (the LRU lists' tails, what reclaim takes first)."""
    stat = _memory_stat(host, rel)
    if "total_inactive_file" in stat:
        return stat["total_inactive_file"] + (stat.get("total_inactive_anon", 0) if anon else 0)
    return stat.get("inactive_file", 0) + (stat.get("inactive_anon", 0) if anon else 0)


def reclaim_idle(host: CgroupHost, rel: str, *, anon: bool) -> tuple[int | None, int | None]:
    """Reclaim a *running* sandbox that has been idle: (usage before, after). Blocking.

    Without ``anon`` only page cache goes (running sandboxes stay off swap: a v1
    sandbox's swappiness is 0, and v2 is asked ``swappiness=0``); with ``anon`` (host
    memory pressure, swap present) anonymous memory goes to swap as a pause does.

    v2: ``memory.reclaim`` of the cold (inactive) bytes only: the kernel takes them from
    the LRU tails, what the sandbox touched last stays. v1 has no such interface.
    Measured here on a running v1 cgroup holding 64 MiB of inactive page cache and
    22 MiB of anon, swappiness 0: ``memory.force_empty`` 91 ms, cache 64 -> 0 MiB;
    ``memory.soft_limit_in_bytes=0`` nothing at all in 1 s (it acts only under global
    pressure); shrinking ``memory.limit_in_bytes`` to usage minus the inactive bytes and
    back 40 ms, the same result, but a crash mid-way leaves the lowered limit and a
    sandbox that allocates meanwhile meets it. So v1 uses ``force_empty`` (the extra
    time is its retries on anon that cannot go): on an idle sandbox it takes what is
    cold in practice (the hot set is the agent's few pages), and, like the v2 path, it
    also shrinks the cgroup's slab (dentries, inodes)."""
    rel = rel.strip("/")
    if not anon and file_bytes(host, rel) < MIN_RECLAIM_BYTES:
        before = host.memory_usage(rel)
        return before, before
    if "memory" in host.v1:
        return reclaim(host, rel, swap=anon)
    before = host.memory_usage(rel)
    if host.layout is Layout.V2 and host.v2 is not None and before:
        amount = cold_bytes(host, rel, anon=anon)
        if amount >= MIN_RECLAIM_BYTES:
            target = host.v2 / rel / "memory.reclaim"
            swappiness = PAUSE_SWAPPINESS if anon else 0
            try:
                target.write_text(f"{amount} swappiness={swappiness}")
            except OSError as exc:
                if exc.errno == errno.EINVAL and anon:  # no swappiness= on this kernel
                    with contextlib.suppress(OSError):
                        target.write_text(str(amount))
                # EAGAIN: less than asked could be reclaimed; without anon on a kernel
                # that lacks swappiness= the write is skipped rather than risk swapping
    return before, host.memory_usage(rel)
