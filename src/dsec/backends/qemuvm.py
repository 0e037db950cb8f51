"""What the two QEMU backends (microvm, fullvm) share about where and how big a VM is.

Both run each sandbox as one jailed QEMU in a directory of its own under ``vms_dir``
and a cgroup of its own under ``cgroup_parent``, charged with the guest's RAM plus
QEMU's own overhead; both refuse a memory limit below what their guest needs to boot,
and neither is ever overcommitted (guest RAM stays resident once touched). One
definition here instead of a copy in each backend: the numbers stay per backend
(``vmm_overhead_mb``, ``min_memory_mb``), the rules are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, NoReturn

from dsec.api.spec import DSecRunArgs, RunArgs
from dsec.errors import BackendError, LimitExceeded
from dsec.resources import oom, qos
from dsec.resources.cgroups import CgroupHost
from dsec.threads import undo_to_the_end

MiB = 1 << 20


def last_line(console: str, limit: int = 160) -> str:
    """The guest's last console line, cut short: guest-written text for a reason an
    operator reads (quoted with repr by the caller, so no control character passes)."""
    lines = [line.strip() for line in console.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


async def undo_failed_create(
    exc: BaseException,
    console_tail: Callable[[], Awaitable[str]],
    teardown: Callable[[], Awaitable[None]],
) -> NoReturn:
    """The end of a VM create that failed with ``exc``, one way for both backends: read
    what the guest printed last (while QEMU may still run), tear everything down to the
    end even if cancelled meanwhile (Backend.create: on failure nothing is left behind;
    the teardown's own failure is not the news), and raise ``exc``. A BackendError says
    the console's last line, quoted: often the only clue why a guest did not come up."""

    async def undo() -> str:
        tail = await console_tail()
        with contextlib.suppress(Exception):
            await teardown()
        return tail

    tail = await undo_to_the_end(undo())
    if isinstance(exc, BackendError) and (said := last_line(tail)):
        raise BackendError(f"{exc.message}; the guest console's last line: {said!r}") from exc
    raise exc


class QemuVMBackend:
    """Mixin for a Backend whose sandboxes are QEMU processes (put it before Backend
    in the bases, so that ``committed_memory_mb`` here is the one used)."""

    vms_dir: Path
    cgroup_parent: str  # without slashes around it
    cgroups: CgroupHost
    vmm_overhead_mb: ClassVar[int]  # QEMU's own memory beside the guest's RAM
    min_memory_mb: ClassVar[int]
    min_memory_why: ClassVar[str]  # said in the refusal, e.g. "the guest kernel's own need"
    vm_noun: ClassVar[str]  # "microVM", "fullvm"

    def vm_dir(self, sandbox_id: str) -> Path:
        return self.vms_dir / sandbox_id

    def cgroup_of(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    def check_memory(self, spec: RunArgs) -> None:
        """LimitExceeded below the backend's floor."""
        if spec.memory_limit_mb < self.min_memory_mb:
            raise LimitExceeded(
                f"memory_limit_mb={spec.memory_limit_mb} is below the {self.vm_noun} minimum "
                f"of {self.min_memory_mb} MiB ({self.min_memory_why})",
                minimum_mb=self.min_memory_mb,
            )

    def cgroup_memory_bytes(self, spec: RunArgs) -> int:
        """The VM cgroup's memory limit: the guest's RAM and QEMU's own memory."""
        return (spec.memory_limit_mb + self.vmm_overhead_mb) * MiB

    def create_vm_cgroup(self, sandbox_id: str, spec: RunArgs, *, pids: int) -> None:
        """The VM's cgroup: guest RAM plus QEMU's overhead, the CPU quota, ``pids``
        tasks, and the weight of its QoS class (best_effort: ``cpu.idle`` too, where
        the kernel has it). The class's scheduling goes on QEMU with ``start_qos``."""
        self.cgroups.create_limited(
            self.cgroup_of(sandbox_id),
            memory_bytes=self.cgroup_memory_bytes(spec),
            cpu_cores=spec.cpu_cores_limit,
            pids=pids,
            cpu_shares=qos.cpu_shares(spec.qos),
            cpu_idle=spec.qos == "best_effort" and self.cgroups.has_cpu_idle,
        )

    @staticmethod
    def start_qos(spec: RunArgs, pid: int) -> None:
        """A QEMU just started (created, or restored from its file) takes the sandbox's
        class before its guest runs, so every vCPU and I/O thread it starts inherits
        it: SCHED_IDLE for best_effort, the core-scheduling cookie for latency where
        the kernel has core scheduling; and the class's OOM bias (dsec.resources.oom)."""
        oom.set_oom_score_adj(pid, oom.oom_score_adj(spec.qos))
        if qos.acts_on(spec.qos):
            qos.apply(spec.qos, [pid])

    def committed_memory_mb(self, spec: DSecRunArgs, overcommit: float) -> int:
        """Guest RAM stays resident once touched (no balloon) and QEMU's own memory
        comes on top: a VM is never overcommitted (bench_microvm: ~180 MiB per idle
        256 MiB microVM, and admission at the limit would have let 5x too many in)."""
        return math.ceil((spec.memory_limit_mb + self.vmm_overhead_mb) * overcommit)

    async def remove_parent_cgroup_if_empty(self) -> None:
        """At close: the backend's parent cgroup goes when no VM is left in it (running
        VMs stay for the next edge process to adopt)."""
        if not self.cgroups.children(f"/{self.cgroup_parent}"):
            await asyncio.to_thread(
                self.cgroups.kill_and_remove, f"/{self.cgroup_parent}", timeout=1
            )
