"""The in-memory backend itself (dsec.backends.memory): off unless asked for, honest
about its capabilities, its specs reach the edge, and its sweep and facts behave
like a real backend's."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind, DSecMemoryRunArgs, run_args_adapter
from dsec.backends.base import Capability, CreateInput, SandboxRecord
from dsec.backends.kinds import require_backend
from dsec.backends.memory.backend import ENV, MemoryBackend, MemoryFacts
from dsec.backends.memory.world import MemoryWorld
from dsec.backends.registry import BackendRegistry

IMAGE = ImageInfo(
    name="scratch", tag="", digest="", layers=[], size_bytes=0, created_at=datetime.now(UTC)
)


def test_the_probe_refuses_unless_the_test_env_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    registry = BackendRegistry()
    reason = registry.probe(BackendKind.MEMORY)
    assert reason is not None and ENV in reason
    assert BackendKind.MEMORY not in registry.select(None).enabled  # never on by default
    monkeypatch.setenv(ENV, "other, memory")
    assert registry.probe(BackendKind.MEMORY) is None
    assert registry.select(["memory"]).enabled == (BackendKind.MEMORY,)


def test_spec_parses_round_trips_and_has_a_backend() -> None:
    spec = run_args_adapter.validate_json('{"backend": "memory", "image": "toy"}')
    assert isinstance(spec, DSecMemoryRunArgs) and spec.image_ref == "toy"
    assert run_args_adapter.validate_json(spec.model_dump_json()) == spec
    assert require_backend(spec) is spec


def test_capabilities_are_files_only() -> None:
    assert MemoryBackend.capabilities == frozenset({Capability.FILES})


def _record(sid: str, facts: MemoryFacts) -> SandboxRecord:
    now = datetime.now(UTC)
    return SandboxRecord(
        id=sid,
        spec=DSecMemoryRunArgs(),
        image=IMAGE,
        state=SandboxState.RUNNING,
        created_at=now,
        updated_at=now,
        edge="e1",
        facts=facts,
    )


async def test_facts_name_one_incarnation_and_sweep_removes_the_unknown() -> None:
    world = MemoryWorld()
    backend = MemoryBackend(world)
    facts = await backend.create(CreateInput(id="e1-a", spec=DSecMemoryRunArgs(), image=IMAGE))
    assert isinstance(facts, MemoryFacts)
    loaded = backend.load_facts(facts.to_json())
    assert loaded == facts
    rec = _record("e1-a", facts)
    assert await backend.is_alive(rec)
    # Recreated under the same id: the old record's facts no longer match.
    await backend.create(CreateInput(id="e1-a", spec=DSecMemoryRunArgs(), image=IMAGE))
    assert not await backend.is_alive(rec)
    await backend.create(CreateInput(id="e1-b", spec=DSecMemoryRunArgs(), image=IMAGE))
    assert await backend.sweep({"e1-a"}) == ["e1-b"]
    assert world.ids() == ["e1-a"]
    await backend.destroy(rec)
    await backend.destroy(rec)  # idempotent
    assert world.ids() == []
