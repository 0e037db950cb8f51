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
import math
from pathlib import Path
from typing import ClassVar

from dsec.api.spec import DSecRunArgs, RunArgs
from dsec.errors import LimitExceeded
from dsec.resources import oom, qos
from dsec.resources.cgroups import CgroupHost

MiB = 1 << 20


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
