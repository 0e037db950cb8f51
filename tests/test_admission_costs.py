"""Admission charges each sandbox what its backend says it commits of host memory.

A container uses a fraction of its limit (hence the overcommit factor); a microVM holds
its guest RAM once touched plus its VMM's own memory, so admission that charged only
the limit let several times more VMs in than fit (bench/bench_microvm.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dsec.api.spec import DSecMemoryRunArgs, DSecMicroVMRunArgs, DSecRunArgs
from dsec.backends.memory.backend import MemoryBackend
from dsec.backends.memory.world import MemoryWorld
from dsec.backends.microvm.backend import VMM_OVERHEAD_MB, MicroVMBackend
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.errors import AdmissionRejected
from dsec.security.audit import AuditLog


class HeavyMemory(MemoryBackend):
    """A backend whose sandboxes commit three times their limit."""

    def committed_memory_mb(self, spec: DSecRunArgs, overcommit: float) -> int:
        return 3 * spec.memory_limit_mb


async def test_the_edge_charges_what_the_backend_commits(tmp_path: Path) -> None:
    state = EdgeStateDB(tmp_path / "edge.db")
    admission = Admission(max_sandboxes=10, memory_overcommit=1.0)
    admission.memory_budget_mb = 1000
    edge = Edge(
        edge_id="e1",
        backends=[HeavyMemory(MemoryWorld())],
        images=None,  # type: ignore[arg-type]  # the memory kind needs no images
        state=state,
        admission=admission,
        audit=AuditLog(None),
    )
    try:
        await edge.start()
        first = await edge.create(DSecMemoryRunArgs(memory_limit_mb=300), timeout=5)
        assert admission.memory_mb == 900
        with pytest.raises(AdmissionRejected):  # 900 + 300 > 1000, though 600 would fit
            await edge.create(DSecMemoryRunArgs(memory_limit_mb=100), timeout=5)
        await edge.stop(first.id)
        assert admission.memory_mb == 0
    finally:
        await edge.close()
        state.close()


def test_a_microvm_is_never_overcommitted() -> None:
    spec = DSecMicroVMRunArgs(image="busybox", memory_limit_mb=256)
    # The charge is a property of the spec and the backend's class (its VMM overhead):
    # an instance without any state is enough.
    backend = MicroVMBackend.__new__(MicroVMBackend)
    charge = backend.committed_memory_mb(spec, 8.0)
    assert charge == math.ceil((256 + VMM_OVERHEAD_MB) * 8.0)
