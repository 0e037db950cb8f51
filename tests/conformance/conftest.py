"""Harnesses for the backend conformance suite: one per backend that can run
in-process (a real Edge on a real EdgeStateDB and AuditLog, no image service).

A harness builds the edge afresh on the same state directory, so a test can close an
edge without stopping its sandboxes and start another that must re-adopt them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsec.api.spec import BackendKind, DSecMemoryRunArgs, RunArgs
from dsec.backends.base import Backend
from dsec.backends.memory.backend import MemoryBackend
from dsec.backends.memory.world import MemoryWorld
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.security.audit import AuditLog


@dataclass
class Harness:
    """One backend under test, and the edges built around it."""

    kind: BackendKind
    make_backend: Callable[[], Backend]
    make_spec: Callable[..., RunArgs]
    kill: Callable[[str], object]  # a sandbox dies behind the edge's back
    state_dir: Path
    max_sandboxes: int = 4
    edges: list[Edge] = field(default_factory=list)
    states: list[EdgeStateDB] = field(default_factory=list)
    audit: AuditLog = field(default_factory=lambda: AuditLog(None))
    last_recovery: dict[str, list[str]] = field(default_factory=dict)

    async def edge(self, *, stop_on_close: bool = True) -> Edge:
        """A started Edge on this harness's state DB (a restart when one ran before)."""
        state = EdgeStateDB(self.state_dir / "edge.db")
        self.audit = AuditLog(None)  # the edge closes its audit log with it
        self.states.append(state)
        edge = Edge(
            edge_id="e1",
            backends=[self.make_backend()],
            images=None,  # type: ignore[arg-type]  # conformance kinds need no images
            state=state,
            admission=Admission(max_sandboxes=self.max_sandboxes, memory_overcommit=1.0),
            audit=self.audit,
            ttl_interval=0.05,
            stop_on_close=stop_on_close,
        )
        self.edges.append(edge)
        self.last_recovery = await edge.start()
        return edge

    async def restart(self, edge: Edge, *, while_down: Callable[[], object] = lambda: None) -> Edge:
        """Close ``edge`` leaving its sandboxes running, run ``while_down``, then start
        a new edge on the same state DB."""
        edge.stop_on_close = False
        await edge.close()
        self.edges.remove(edge)
        while_down()
        return await self.edge()

    async def close(self) -> None:
        for edge in self.edges:
            await edge.close()
        for state in self.states:
            state.close()


def _memory(tmp_path: Path) -> Harness:
    world = MemoryWorld()  # per test: nothing leaks between tests
    return Harness(
        kind=BackendKind.MEMORY,
        make_backend=lambda: MemoryBackend(world),
        make_spec=lambda **kw: DSecMemoryRunArgs(**kw),
        kill=world.kill,
        state_dir=tmp_path,
    )


# Kinds with an in-process harness. The container backend needs root, crun and images:
# it is exercised by tests/test_platform_e2e.py, not (yet) by this suite.
HARNESSES: dict[BackendKind, Callable[[Path], Harness]] = {BackendKind.MEMORY: _memory}


@pytest.fixture(params=sorted(HARNESSES), ids=lambda k: k.value)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    h = HARNESSES[request.param](tmp_path)
    try:
        yield h
    finally:
        await h.close()
