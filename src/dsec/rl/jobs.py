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
* with swap (by default the platform's own file, dsec.resources.swap; or
  ``DSEC_SWAP_FILE``, or the operator's own), v1: the
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

Resume reads the swapped memory back ahead of use (``MADV_WILLNEED`` through
process_madvise, dsec.resources.prefetch), in two passes: every sandbox's small
processes (agent, shells), then the large heaps. A job resume waits up to
PREFETCH_WAIT for the first pass before it answers; a thaw by a request starts both
beside the request. Measured (bench/bench_pause.py, 16 sandboxes x 256 MiB of 4 KiB
heap pages, loaded 2-core host): the first command that touches all the memory took
2.9 s after a resume with prefetch, 21.3 s without; swap-in here is bound by the swap
device's 4 KiB reads.

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
import logging
import os
import time
from typing import TYPE_CHECKING

from dsec.api.events import AuditKind
from dsec.api.fields import TRAJECTORY_NAME_RE
from dsec.api.rl import JOB_ID_MAX, JobPauseReport, JobResumeReport, SandboxPause
from dsec.api.sandbox import SandboxState
from dsec.backends.base import Capability, ReclaimFigures
from dsec.errors import BackendError, InvalidArgument, Unsupported
from dsec.resources.reclaim import swap_available

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
# How long a job resume waits for the first pass of its sandboxes' prefetch (their
# small processes) before it answers; the rest goes on in the background.
PREFETCH_WAIT = 2.0
# A resume prefetches processes with at most this much in swap first, in every sandbox
# of the job, before any larger one (the agent and shells before the heaps).
SMALL_PROCESS_BYTES = 16 << 20
SMALL = (0, SMALL_PROCESS_BYTES)
LARGE = (SMALL_PROCESS_BYTES, None)


def check_job_id(job_id: str) -> str:
    """The same rule as a spec's ``job_id`` (a job no spec can carry has no sandboxes)."""
    if not TRAJECTORY_NAME_RE.match(job_id):
        raise InvalidArgument(
            f"invalid job id {job_id[:200]!r}: 1-{JOB_ID_MAX} letters, digits and ._:@-"
        )
    return job_id


class JobControl:
    """Pause/resume of one edge's sandboxes by job; owned by the Edge."""

    def __init__(self, edge: Edge, *, prefetch: bool = True) -> None:
        self.edge = edge
        self._reclaims = asyncio.Semaphore(RECLAIM_CONCURRENCY)
        # Resume prefetch (dsec.resources.prefetch): a job resume reads the sandboxes'
        # swapped memory back before it answers; a thaw by a request starts it beside
        # the request (which must not wait for the whole sandbox).
        self.prefetch = prefetch
        self._prefetches: set[asyncio.Task[int]] = set()
        self._prefetch_slots = asyncio.Semaphore(RECLAIM_CONCURRENCY)

    def _job(self, job_id: str, states: set[SandboxState]) -> list[SandboxRecord]:
        return self.edge.records_of_job(job_id, states)

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

    async def pause_sandbox(self, sandbox_id: str) -> SandboxPause | None:
        """Freeze and reclaim one sandbox the way a job pause does (a hosted rollout
        whose model endpoint is down, dsec.rollouts); None: it was not running."""
        rec = self.edge.find(sandbox_id)
        if rec is None:
            return None
        return await self._pause_one(rec, swap_available())

    async def _pause_one(self, rec: SandboxRecord, swap: bool) -> SandboxPause | None:
        async with self.edge.exclusive(rec.id):  # waits for a verify or a stop in flight
            if rec.state is not SandboxState.RUNNING:
                return None
            t0 = time.perf_counter()
            try:
                backend = self.edge.backend_of(rec, Capability.PAUSE)  # refused before work
                # On the loop, not in a thread: no request can see RUNNING once frozen.
                backend.pause(rec)
            except (BackendError, Unsupported) as exc:
                return SandboxPause(
                    sandbox_id=rec.id, duration=time.perf_counter() - t0, error=str(exc)
                )
            self.edge.transition(rec, SandboxState.PAUSED)
            freeze = time.perf_counter() - t0
        for listener in self.edge.pause_listeners:
            await listener(rec.id)
        async with self._reclaims:
            t1 = time.perf_counter()
            try:
                got = await backend.reclaim(rec, swap=swap)
            except Unsupported:
                got = ReclaimFigures(None, None, None, None, None)
            reclaim_s = time.perf_counter() - t1
        duration = freeze + reclaim_s
        self.edge.metrics.paused(str(rec.spec.backend), duration)
        self.edge.audit.record(
            rec.id,
            AuditKind.LIFECYCLE,
            "pause",
            job_id=rec.spec.job_id,
            memory_before=got.before,
            memory_after=got.after,
            anon=got.anon_after,
            anon_before=got.anon_before,
            swap=got.swap,
            freeze=round(freeze, 6),
            reclaim=round(reclaim_s, 6),
        )
        return SandboxPause(
            sandbox_id=rec.id,
            memory_before_bytes=got.before,
            memory_after_bytes=got.after,
            anon_bytes=got.anon_after,
            anon_before_bytes=got.anon_before,
            swap_bytes=got.swap,
            duration=duration,
            freeze_seconds=freeze,
            reclaim_seconds=reclaim_s,
        )

    # -- resume ---------------------------------------------------------------------------
    async def resume_job(self, job_id: str) -> JobResumeReport:
        check_job_id(job_id)
        start = time.perf_counter()
        thawed = []
        for rec in self._job(job_id, {SandboxState.PAUSED}):
            if self.thaw(rec, cause="resume_job", prefetch=False):
                thawed.append(rec)
        advised, pending = 0, 0
        if self.prefetch and thawed:
            # Waited for up to PREFETCH_WAIT: a job of 100 x 256 MiB reads 25 GiB back,
            # the answer must not wait for all of it; the rest goes on behind it.
            # First every sandbox's small processes (the agent, shells: what the next
            # command needs), then the large heaps, which would otherwise queue
            # gigabytes of reads ahead of them (bench/bench_pause.py).
            # The answer waits for the first pass only: a command right after it finds
            # its agent and shell in RAM, the heaps stream in behind it.
            small = [self._start_prefetch(r, SMALL) for r in thawed]
            large = [self._start_prefetch(r, LARGE, after=small[i]) for i, r in enumerate(thawed)]
            await asyncio.wait(small, timeout=PREFETCH_WAIT)
            advised = sum(t.result() for t in (*small, *large) if t.done() and not t.cancelled())
            pending = sum(1 for t in large if not t.done())
        return JobResumeReport(
            job_id=job_id,
            resumed=len(thawed),
            duration=time.perf_counter() - start,
            sandbox_ids=[r.id for r in thawed],
            prefetched_bytes=advised,
            prefetch_pending=pending,
        )

    def _start_prefetch(
        self,
        rec: SandboxRecord,
        swapped: tuple[int, int | None],
        *,
        after: asyncio.Task[int] | None = None,
    ) -> asyncio.Task[int]:
        task = asyncio.get_running_loop().create_task(self._prefetch(rec, swapped, after=after))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)
        return task

    async def _prefetch(
        self,
        rec: SandboxRecord,
        swapped: tuple[int, int | None],
        *,
        after: asyncio.Task[int] | None = None,
    ) -> int:
        """Read ``rec``'s swapped memory back ahead of use; bytes advised (0: none)."""
        if after is not None:
            await asyncio.wait([after])
        try:
            async with self._prefetch_slots:
                return await self.edge.backend_of(rec).prefetch(rec, swapped=swapped)
        except Unsupported:
            return 0
        except Exception as exc:  # gone meanwhile; a kernel without process_madvise
            log.debug("resume prefetch of %s: %s", rec.id, exc)
            return 0

    def thaw(self, rec: SandboxRecord, *, cause: str, prefetch: bool = True) -> bool:
        """PAUSED -> RUNNING, synchronously (one freezer write, one edge.db row): this
        is what makes the next request to a paused sandbox resume it transparently."""
        if rec.state is not SandboxState.PAUSED:
            return False
        t0 = time.perf_counter()
        self.edge.backend_of(rec).resume(rec)
        rec.last_activity = time.monotonic()  # paused time never counts toward the TTL
        self.edge.transition(rec, SandboxState.RUNNING)
        for listener in self.edge.thaw_listeners:  # e.g. the data plane's live restore
            listener(rec.id)
        took = time.perf_counter() - t0
        if prefetch and self.prefetch:
            with contextlib.suppress(RuntimeError):  # no loop: nothing to run it on
                small = self._start_prefetch(rec, SMALL)
                self._start_prefetch(rec, LARGE, after=small)
        self.edge.metrics.resumed(str(rec.spec.backend), took)
        self.edge.audit.record(
            rec.id,
            AuditKind.LIFECYCLE,
            "resume",
            job_id=rec.spec.job_id,
            cause=cause,
            duration=round(took, 6),
        )
        return True

    def release(self, rec: SandboxRecord) -> None:
        """Before a teardown: frozen tasks cannot die of SIGKILL until thawed."""
        if rec.state is SandboxState.PAUSED:
            backend = self.edge.backend_of(rec)
            if backend.destroy_needs_resume:
                with contextlib.suppress(Unsupported):
                    backend.resume(rec)

    # -- recovery -------------------------------------------------------------------------
    async def recover(self, rec: SandboxRecord) -> bool:
        """After an edge restart: a PAUSED sandbox whose container still exists is
        adopted and kept frozen (its agent cannot answer a ping while frozen, so the
        usual liveness check does not apply). False: it is gone."""
        return await self.edge.backend_of(rec).adopt_paused(rec)
