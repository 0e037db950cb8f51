"""dsec.apiserver.creator with an edge that names sandboxes up front (NamedCreates): the
quota is charged once, under the sandbox's final id, and given back if the create
fails. A stub edge over a real IAM (SQLite): no platform, ~0.3 s."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dsec.api.iam import QuotaLimits
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import BackendKind, DSecContainerRunArgs, RunArgs
from dsec.apiserver.creator import SandboxCreator
from dsec.control.db import make_engine, migrate, sqlite_url
from dsec.control.iam import IAM, PENDING_PREFIX
from dsec.edge.api import NamedCreates
from dsec.errors import BackendError, DSecError


class NamedEdge:
    """Just enough of an edge: names sandboxes, makes them (or fails), records ids."""

    edge_id = "e1"

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.made: list[str] = []
        self.named: list[str] = []
        self.forgotten: list[str] = []
        self.events: list[str] = []  # forgets, and what a test adds beside them

    def new_sandbox_id(self, spec: RunArgs | None = None) -> str:
        sid = f"{self.edge_id}-{secrets.token_hex(8)}"
        self.named.append(sid)
        return sid

    def forget_sandbox_id(self, sandbox_id: str) -> None:
        self.forgotten.append(sandbox_id)
        self.events.append(f"forget {sandbox_id}")

    async def create_named(self, spec: RunArgs, *, timeout: float, sandbox_id: str) -> SandboxInfo:
        self.made.append(sandbox_id)
        if self.fail:
            raise BackendError("the runtime failed")
        now = datetime.now(UTC)
        return SandboxInfo(
            id=sandbox_id,
            backend=BackendKind.CONTAINER,
            state=SandboxState.RUNNING,
            image=spec.image_ref,
            created_at=now,
            updated_at=now,
            edge=self.edge_id,
            spec=spec,
        )

    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        raise AssertionError("an edge that names sandboxes is asked by name")


@pytest.fixture
async def iam(tmp_path: Path) -> AsyncIterator[IAM]:
    engine = make_engine(sqlite_url(tmp_path / "control.db"))
    await migrate(engine)
    iam = IAM(engine, cache_ttl=0.0)
    try:
        await iam.ensure_bootstrap()
        yield iam
    finally:
        await iam.close()
        await engine.dispose()


SPEC = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)


async def test_charged_once_under_the_final_id(iam: IAM) -> None:
    edge = NamedEdge()
    assert isinstance(edge, NamedCreates)
    creator = SandboxCreator(edge, iam=iam)  # type: ignore[arg-type]  # a stub edge
    info = await creator.create("admin", SPEC, timeout=10)
    assert edge.made == [info.id]
    assert [sid for sid, _ in await iam.charger.charged()] == [info.id]
    assert await iam.charger.charged(PENDING_PREFIX) == []  # nothing provisional
    assert await iam.release(info.id)


async def test_a_failed_create_gives_the_charge_back(iam: IAM) -> None:
    edge = NamedEdge(fail=True)
    creator = SandboxCreator(edge, iam=iam)  # type: ignore[arg-type]  # a stub edge
    with pytest.raises(BackendError):
        await creator.create("admin", SPEC, timeout=10)
    assert len(edge.made) == 1
    assert await iam.charger.charged() == []


async def test_a_refused_charge_frees_the_id_it_was_named_with(iam: IAM) -> None:
    """Over quota: no create follows, so whatever the edge held under the id (a warm
    sandbox, dsec.edge.warmpool) is given back at once."""
    edge = NamedEdge()
    creator = SandboxCreator(edge, iam=iam)  # type: ignore[arg-type]  # a stub edge
    project = "q" + secrets.token_hex(3)
    await iam.create_project("admin", project)
    await iam.set_quota("admin", project, QuotaLimits(max_sandboxes=0))
    with pytest.raises(DSecError) as refused:
        await creator.create("admin", SPEC.model_copy(update={"project": project}), timeout=10)
    assert refused.value.status == 429
    assert edge.made == [] and edge.forgotten == edge.named and len(edge.named) == 1
    assert await iam.charger.charged() == []


async def test_a_failed_create_frees_its_id_only_after_the_charge_is_given_back(
    iam: IAM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id may name a warm sandbox held for this create: freed before the charge
    under it is gone, the next create handed the same sandbox charges under the same
    id and gets 409 already_exists (seen in a batch with admission refusals)."""
    edge = NamedEdge(fail=True)
    creator = SandboxCreator(edge, iam=iam)  # type: ignore[arg-type]  # a stub edge
    release = iam.release

    async def noted_release(sandbox_id: str) -> bool:
        done = await release(sandbox_id)
        edge.events.append(f"release {sandbox_id}")
        return done

    monkeypatch.setattr(iam, "release", noted_release)
    with pytest.raises(BackendError):
        await creator.create("admin", SPEC, timeout=10)
    (sid,) = edge.named
    assert edge.events == [f"release {sid}", f"forget {sid}"]
    assert await iam.charger.charged() == []
