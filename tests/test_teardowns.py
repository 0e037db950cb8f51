"""A teardown that failed is tried again until it succeeds (dsec.edge.teardowns): on the
edge's loop while it runs, and once more at close while the backends are still open.
A teardown can fail for a reason that passes (the edge out of fds for a moment); the
sandbox's kernel objects must not stay on the host until the next start's sweep."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from dsec.api.sandbox import SandboxState
from dsec.api.spec import DSecMemoryRunArgs
from dsec.backends.base import BackendFacts, CreateInput, SandboxRecord
from dsec.backends.memory.backend import MemoryBackend, MemoryFacts
from dsec.backends.memory.world import MemoryWorld
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.edge.teardowns import UnfinishedTeardowns
from dsec.errors import BackendError
from dsec.security.audit import AuditLog


class FlakyTeardown(MemoryBackend):
    """Its destroy fails the next ``fails`` times (as out of fds would), then works."""

    def __init__(self, world: MemoryWorld) -> None:
        super().__init__(world)
        self.fails = 0
        self.tries = 0

    async def destroy(self, rec: SandboxRecord) -> None:
        self.tries += 1
        if self.fails:
            self.fails -= 1
            raise BackendError("cleanup incomplete: [Errno 24] Too many open files")
        await super().destroy(rec)


def edge_over(backend: MemoryBackend, tmp_path: Path) -> Edge:
    """An edge "e1" over ``backend`` on a real state DB in ``tmp_path`` (its close
    closes the DB)."""
    return Edge(
        edge_id="e1",
        backends=[backend],
        images=None,  # type: ignore[arg-type]  # the memory kind needs no images
        state=EdgeStateDB(tmp_path / "edge.db"),
        admission=Admission(max_sandboxes=10),
        audit=AuditLog(None),
    )


@contextlib.asynccontextmanager
async def running_edge(tmp_path: Path) -> AsyncIterator[tuple[Edge, FlakyTeardown]]:
    """An edge on a real state DB over a flaky memory backend; closed on the way out."""
    backend = FlakyTeardown(MemoryWorld())
    edge = edge_over(backend, tmp_path)
    try:
        await edge.start()
        yield edge, backend
    finally:
        await edge.close()


async def test_a_failed_teardown_is_done_again_while_the_edge_runs(tmp_path: Path) -> None:
    async with running_edge(tmp_path) as (edge, backend):
        info = await edge.create(DSecMemoryRunArgs(), timeout=5)
        backend.fails = 2
        stopped = await edge.stop(info.id)
        assert stopped.state is SandboxState.FAILED
        assert "teardown incomplete" in (stopped.reason or "")
        assert backend.world.get(info.id) is not None  # still on the "host"
        assert await edge.teardowns.retry() == 1  # fails once more
        assert await edge.teardowns.retry() == 0
        assert backend.world.get(info.id) is None and backend.tries == 3
        assert len(edge.teardowns) == 0
        after = await edge.get(info.id)  # still failed (it was cut off), and says the rest
        assert after.state is SandboxState.FAILED
        assert (after.reason or "").endswith("teardown completed on try 3")


async def test_close_tries_a_failed_teardown_again(tmp_path: Path) -> None:
    async with running_edge(tmp_path) as (edge, backend):
        info = await edge.create(DSecMemoryRunArgs(), timeout=5)
        backend.fails = 1
        await edge.stop(info.id)
        assert backend.world.get(info.id) is not None
    assert backend.world.get(info.id) is None


async def test_only_successes_are_reported_and_every_record_is_tried() -> None:
    done: list[tuple[str, int]] = []
    failing = {"b"}

    async def destroy(rec: SandboxRecord) -> None:
        if rec.id in failing:
            raise BackendError("busy")

    teardowns = UnfinishedTeardowns(destroy, lambda rec, n: done.append((rec.id, n)))
    # only the id is read: a stand-in record will do
    recs = [cast(SandboxRecord, SimpleNamespace(id=sid)) for sid in ("a", "b")]
    for rec in recs:
        teardowns.add(rec)
    assert await teardowns.retry() == 1 and done == [("a", 2)]
    failing.clear()
    assert await teardowns.retry() == 0 and done == [("a", 2), ("b", 3)]


@dataclass(frozen=True)
class _ProcessFacts(MemoryFacts):
    """A memory sandbox whose "init" is a real process: the edge's death watch sees it."""

    pid: int = 0

    @property
    def init_pid(self) -> int | None:
        return self.pid


class SlowTeardownOfARealInit(MemoryBackend):
    """Its sandboxes' init is a real ``sleep``; its destroy takes ``teardown_s``."""

    def __init__(self, world: MemoryWorld, teardown_s: float) -> None:
        super().__init__(world)
        self.teardown_s = teardown_s
        self.inits: list[asyncio.subprocess.Process] = []

    async def create(self, inp: CreateInput) -> BackendFacts:
        facts = await super().create(inp)
        assert isinstance(facts, MemoryFacts)
        self.inits.append(await asyncio.create_subprocess_exec("sleep", "60"))
        return _ProcessFacts(facts.boot, pid=self.inits[-1].pid)

    async def destroy(self, rec: SandboxRecord) -> None:
        await asyncio.sleep(self.teardown_s)
        await super().destroy(rec)


@pytest.mark.parametrize("stop_on_close", [True, False], ids=["stop-all", "live-restore"])
async def test_close_lets_the_teardown_of_a_death_it_just_saw_finish(
    tmp_path: Path, stop_on_close: bool
) -> None:
    """A sandbox whose init died just before a shutdown is being torn down by then.
    The close waits for that teardown (DEATH_TEARDOWN_GRACE) instead of cancelling it,
    which lost how the sandbox ended (a stop-all then recorded "shut down") or, where
    sandboxes live on, left a STOPPING record and its kernel objects to the next start."""
    backend = SlowTeardownOfARealInit(MemoryWorld(), teardown_s=1.0)
    edge = edge_over(backend, tmp_path)
    try:
        edge.stop_on_close = stop_on_close
        await edge.start()
        info = await edge.create(DSecMemoryRunArgs(), timeout=5)
        init = backend.inits[0]
        init.kill()
        await init.wait()
        for _ in range(1000):  # the death is seen: its teardown has begun
            if (await edge.get(info.id)).state is SandboxState.STOPPING:
                break
            await asyncio.sleep(0.01)
        assert (await edge.get(info.id)).state is SandboxState.STOPPING
    finally:
        await edge.close()
        for proc in backend.inits:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert backend.world.get(info.id) is None, "the teardown ran to its end"
    again = EdgeStateDB(tmp_path / "edge.db")  # what the next start reads
    rows = {rec.id: rec for rec in again.load("e1")}
    again.close()
    assert rows[info.id].state is SandboxState.FAILED
    assert "init process died" in (rows[info.id].reason or "")
