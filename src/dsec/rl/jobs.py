"""Job-level pause and resume (DSEC.md §6.3): freeze every sandbox of an RL job, give
their memory back to the host, keep all their state; thaw on resume or on the next
request to one of them.

Why a freeze and not a checkpoint: a cgroup freezer write costs ~0.2 ms and keeps every
kernel object (sockets, pipes, the overlay) as it is; criu costs ~100 ms per process and
a restore can fail. What a pause can give back depends on the host:

* page cache charged to the sandbox (files it read or wrote) is always reclaimable:
  v1 ``memory.force_empty`` (works on a frozen cgroup with live tasks: it reclaims what
  it can, then returns), v2 ``memory.reclaim``;
* anonymous memory (heaps, tmpfs) can only leave RAM through swap (a swap device, zram,
  or zswap in front of a swap device). Without swap it stays resident, whatever the
  cgroup interface: the report says ``swap_available=False`` and shows what stayed
  (``anon_bytes``), rather than claiming a reclaim that did not happen.
* with swap (``DSEC_SWAP_FILE``, dsec.resources.swap, or the operator's own), v1: the
  frozen cgroup's ``memory.swappiness`` is raised for the time of a ``force_empty`` (the
  platform keeps running sandboxes at 0, and a cgroup reclaim at 0 never swaps), which
  then swaps anon and tmpfs pages out until the cgroup is empty. Where the time goes
  (kernel 6.18, hybrid v1, 2 vCPUs, 64 MiB of random data per cgroup): swapping out
  4 KiB pages is kernel CPU, ~3.5-4.5 us per page (reclaim batches of 32 pages, each
  with a slab-shrinker pass, then a second LRU pass to free each page once its write
  is done), i.e. 60-80 ms per sandbox on one core, not the disk (2.5-3.2 GB/s of 1 MiB
  direct writes here, 64 MiB in ~25 ms). Large folios cut the per-page work ~6x: the
  sandboxes' /dev/shm is ``huge=within_size`` and the platform's swap file sits behind
  a loop device in SSD mode, so a folio goes out whole (dsec.resources.swap); then the
  swap-out waits on the disk and ``RECLAIM_CONCURRENCY`` keeps two per core in flight.
  Shrinking ``memory.limit_in_bytes`` instead costs the same as force_empty (the same
  32-page loop) and leaves a tiny limit behind if we crash mid-way, so it is not used;
  MADV_PAGEOUT through a mapping of the tmpfs file starts the writes ~30% cheaper but
  leaves every page in the swap cache until a force_empty frees it (measured: the sum
  is no cheaper). Limits are never changed, so nothing needs restoring
  on resume; swap does not count against a v1 sandbox (no ``memsw`` limit is set), so
  swapping back in on access cannot OOM it. v2: ``memory.reclaim`` with
  ``swappiness=`` (kernels that know it), else without.

State machine: RUNNING -> PAUSED (frozen, persisted in edge.db) -> RUNNING. The freeze
itself runs on the event loop (sub-millisecond), so a request can never slip between
"state says running" and "cgroup is frozen"; only the reclaim runs in a thread. A paused
sandbox is thawed synchronously by ``Edge.running_record``, i.e. by any exec, file,
session or process request (API or edge data path). TTLs only fire for RUNNING
sandboxes, and a thaw restarts the idle clock, so paused time never counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.errors import BackendError, InvalidArgument, Unsupported
from dsec.model import TRAJECTORY_NAME_RE, SandboxState
from dsec.resources.cgroups import CgroupHost, Layout
from dsec.resources.swap import swap_free_bytes
from dsec.rl_model import JOB_ID_MAX, JobPauseReport, JobResumeReport, SandboxPause
from dsec.security import protected
from dsec.security.events import AuditKind

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.edge.edge import Edge

log = logging.getLogger(__name__)

# Reclaims in flight at once: two per core. Swapping out large folios (tmpfs written in
# big chunks) waits on the disk most of the time (7 ms of CPU in 25 ms per 64 MiB), so
# one per core leaves the disk idle between writebacks; measured on 2 cores, 16 x 64 MiB
# through a loop device: 18.5-20.5 ms per cgroup 2 at a time, 14-17 ms 4 at a time.
# 4 KiB pages are CPU-bound (~4 us each): there, more in flight only stretches each.
RECLAIM_CONCURRENCY = max(2, min(8, 2 * (os.cpu_count() or 1)))
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


def check_job_id(job_id: str) -> str:
    """The same rule as a spec's ``job_id`` (a job no spec can carry has no sandboxes)."""
    if not TRAJECTORY_NAME_RE.match(job_id):
        raise InvalidArgument(
            f"invalid job id {job_id[:200]!r}: 1-{JOB_ID_MAX} letters, digits and ._:@-"
        )
    return job_id


class JobControl:
    """Pause/resume of one edge's sandboxes by job; owned by the Edge."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self._reclaims = asyncio.Semaphore(RECLAIM_CONCURRENCY)

    def _cgroup(self, rec: SandboxRecord) -> tuple[CgroupHost, str]:
        backend = self.edge.backend
        cgroups = getattr(backend, "cgroups", None)
        path = getattr(backend, "_cgroup", None)
        if not isinstance(cgroups, CgroupHost) or path is None:
            raise Unsupported(f"the {backend.kind.value} backend cannot pause sandboxes")
        return cgroups, str(path(rec.id))

    def _job(self, job_id: str, states: set[SandboxState]) -> list[SandboxRecord]:
        return [
            r
            for r in list(self.edge._records.values())
            if r.spec.job_id == job_id and r.state in states
        ]

    # -- pause ----------------------------------------------------------------------------
    async def pause_job(self, job_id: str) -> JobPauseReport:
        """Freeze and reclaim every running sandbox of ``job_id``; idempotent."""
        check_job_id(job_id)
        start = time.perf_counter()
        recs = self._job(job_id, {SandboxState.RUNNING, SandboxState.PAUSED})
        already = sum(1 for r in recs if r.state is SandboxState.PAUSED)
        swap = swap_available()
        results = await asyncio.gather(
            *(self._pause_one(r, swap) for r in recs if r.state is SandboxState.RUNNING)
        )
        done = [p for p in results if p is not None]
        before = sum(p.memory_before_bytes or 0 for p in done if p.error is None)
        after = sum(p.memory_after_bytes or 0 for p in done if p.error is None)
        ok = [p for p in done if p.error is None]
        report = JobPauseReport(
            job_id=job_id,
            paused=sum(1 for p in done if p.error is None),
            already_paused=already,
            failed=sum(1 for p in done if p.error is not None),
            memory_before_bytes=before,
            memory_reclaimed_bytes=max(0, before - after),
            duration=time.perf_counter() - start,
            swap_available=swap,
            sandboxes=done,
            anon_before_bytes=sum(p.anon_before_bytes or 0 for p in ok),
            anon_after_bytes=sum(p.anon_bytes or 0 for p in ok),
        )
        log.info(
            "job %s paused: %d sandboxes, %d bytes reclaimed in %.3fs",
            job_id,
            report.paused,
            report.memory_reclaimed_bytes,
            report.duration,
        )
        return report

    async def _pause_one(self, rec: SandboxRecord, swap: bool) -> SandboxPause | None:
        async with self.edge._lock(rec.id):  # waits for a verify or a stop in flight
            if rec.state is not SandboxState.RUNNING:
                return None
            t0 = time.perf_counter()
            try:
                host, rel = self._cgroup(rec)
                # On the loop, not in a thread: no request can see RUNNING once frozen.
                protected.freeze(host, rel, timeout=2.0)
            except (BackendError, Unsupported) as exc:
                return SandboxPause(
                    sandbox_id=rec.id, duration=time.perf_counter() - t0, error=str(exc)
                )
            self.edge._set(rec, SandboxState.PAUSED)
            freeze = time.perf_counter() - t0
        async with self._reclaims:
            anon_before = anon_bytes(host, rel)
            t1 = time.perf_counter()
            before, after = await asyncio.to_thread(reclaim, host, rel, swap=swap)
            reclaim_s = time.perf_counter() - t1
        anon = anon_bytes(host, rel)
        swapped = swap_bytes(host, rel)
        duration = freeze + reclaim_s
        self.edge.audit.record(
            rec.id,
            AuditKind.LIFECYCLE,
            "pause",
            job_id=rec.spec.job_id,
            memory_before=before,
            memory_after=after,
            anon=anon,
            anon_before=anon_before,
            swap=swapped,
            freeze=round(freeze, 6),
            reclaim=round(reclaim_s, 6),
        )
        return SandboxPause(
            sandbox_id=rec.id,
            memory_before_bytes=before,
            memory_after_bytes=after,
            anon_bytes=anon,
            anon_before_bytes=anon_before,
            swap_bytes=swapped,
            duration=duration,
            freeze_seconds=freeze,
            reclaim_seconds=reclaim_s,
        )

    # -- resume ---------------------------------------------------------------------------
    async def resume_job(self, job_id: str) -> JobResumeReport:
        check_job_id(job_id)
        start = time.perf_counter()
        ids = []
        for rec in self._job(job_id, {SandboxState.PAUSED}):
            if self.thaw(rec, cause="resume_job"):
                ids.append(rec.id)
        return JobResumeReport(
            job_id=job_id, resumed=len(ids), duration=time.perf_counter() - start, sandbox_ids=ids
        )

    def thaw(self, rec: SandboxRecord, *, cause: str) -> bool:
        """PAUSED -> RUNNING, synchronously (one freezer write, one edge.db row): this
        is what makes the next request to a paused sandbox resume it transparently."""
        if rec.state is not SandboxState.PAUSED:
            return False
        t0 = time.perf_counter()
        host, rel = self._cgroup(rec)
        protected.thaw(host, rel)
        rec.last_activity = time.monotonic()  # paused time never counts toward the TTL
        self.edge._set(rec, SandboxState.RUNNING)
        self.edge.audit.record(
            rec.id,
            AuditKind.LIFECYCLE,
            "resume",
            job_id=rec.spec.job_id,
            cause=cause,
            duration=round(time.perf_counter() - t0, 6),
        )
        return True

    def release(self, rec: SandboxRecord) -> None:
        """Before a teardown: frozen tasks cannot die of SIGKILL until thawed."""
        if rec.state is SandboxState.PAUSED:
            with contextlib.suppress(Unsupported):
                host, rel = self._cgroup(rec)
                protected.thaw(host, rel)

    # -- recovery -------------------------------------------------------------------------
    async def recover(self, rec: SandboxRecord) -> bool:
        """After an edge restart: a PAUSED sandbox whose container still exists is
        adopted and kept frozen (its agent cannot answer a ping while frozen, so the
        usual liveness check does not apply). False: it is gone."""
        backend = self.edge.backend
        runtime = getattr(backend, "runtime", None)
        if runtime is None:
            return False
        state = await runtime.state(rec.id)
        if state is None or state.get("status") not in ("paused", "running", "created"):
            return False
        host, rel = self._cgroup(rec)
        if not host.pids(rel):
            return False
        if not protected.is_frozen(host, rel):
            protected.freeze(host, rel, timeout=2.0)
        _inherit_swappiness(host, rel)
        await backend.adopt(rec)
        return True


def _inherit_swappiness(host: CgroupHost, rel: str) -> None:
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
