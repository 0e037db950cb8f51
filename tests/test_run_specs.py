"""Run specs of every backend as one union on ``backend`` (dsec.api.spec.RunArgs).

The container spec is wire-unchanged (a spec or an edge.db row written by the previous
release still reads); microvm and fullvm specs parse and round-trip; a kind with no
registered backend (fullvm, taken out of the table here) is refused with a typed 501
``Unsupported`` naming it, before any
work: on the HTTP create route, through the SDK (async and sync), for a batch, and on
the edge itself (dsec.backends.kinds is the one place that decides).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

import dsec
from dsec import DSecClient, DSecSyncClient
from dsec.api.batch import CreateBatchRequest
from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.images import ImageInfo
from dsec.api.layers import LayerRef
from dsec.api.sandbox import CreateSandboxRequest, SandboxInfo, SandboxState
from dsec.api.spec import (
    BackendKind,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    DSecRunArgs,
    RunArgs,
    run_args_adapter,
)
from dsec.backends import kinds
from dsec.backends.base import Backend, BackendFacts, BackendHost, CreateInput, SandboxRecord
from dsec.backends.kinds import require_backend
from dsec.backends.registry import BACKENDS
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.idempotency import IdempotencyClaim
from dsec.edge.state import EdgeStateDB
from dsec.errors import Unsupported
from tests.test_apiserver_unit import AUTH, KEY, FakeImages, make_fake_app
from tests.test_sdk_unit import LiveServer

# What the previous release wrote to edge.db for a container sandbox (its
# DSecContainerRunArgs.model_dump_json(), copied verbatim): it must keep loading.
OLD_SPEC_ROW = (
    '{"memory_limit_mb":512,"cpu_cores_limit":1.0,"pids_limit":1024,"disk_limit_mb":null,'
    '"ttl_running_stop":300,"network_rules":{},"init_user":"root","env":{},'
    '"labels":{"team":"rl"},"workdir":"/","job_id":"job-1","trajectory_id":null,'
    '"project":null,"backend":"container","container_image":"busybox:latest",'
    '"workspace":{"name":"task-repo","version":"v3","digest":null},"toolkit":null,'
    '"image_loading":"lazy","protected":[{"path":"/grader","layer":null,'
    '"files":{"answer.txt":""}}]}'
)
OLD_IMAGE_ROW = (
    '{"name":"busybox","tag":"latest","digest":"sha256:' + "a" * 64 + '","layers":'
    '["sha256:' + "b" * 64 + '"],"size_bytes":1234,"created_at":"2026-01-02T03:04:05Z",'
    '"config":{}}'
)


def _old_spec() -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image="busybox:latest",
        workspace=LayerRef("task-repo", "v3"),
        labels={"team": "rl"},
        protected=[{"path": "/grader", "files": {"answer.txt": ""}}],
        job_id="job-1",
    )


# ---- the union ---------------------------------------------------------------------


def test_container_spec_is_wire_unchanged() -> None:
    # Fields added since (with defaults that keep the old behaviour) are all it gains.
    added = {"qos": "latency"}
    assert json.loads(_old_spec().model_dump_json()) == json.loads(OLD_SPEC_ROW) | added
    assert run_args_adapter.validate_json(OLD_SPEC_ROW) == _old_spec()


def test_a_spec_without_backend_is_a_container_spec() -> None:
    """What raw HTTP callers send (the field had a default): no behaviour change."""
    req = CreateSandboxRequest.model_validate({"spec": {"container_image": "busybox"}})
    assert isinstance(req.spec, DSecContainerRunArgs)
    assert req.spec.image_ref == "busybox"


def test_vm_specs_parse_and_round_trip() -> None:
    micro = run_args_adapter.validate_python(
        {"backend": "microvm", "image": "debian:12", "workspace": "task-repo:v3"}
    )
    assert isinstance(micro, DSecMicroVMRunArgs)
    assert micro.workspace == LayerRef("task-repo", "v3") and micro.toolkit is None
    assert micro.image_ref == "debian:12"
    full = run_args_adapter.validate_json('{"backend": "fullvm", "vm_image": "ubuntu:24.04"}')
    assert isinstance(full, DSecFullVMRunArgs) and full.image_ref == "ubuntu:24.04"
    for spec in (micro, full):
        assert run_args_adapter.validate_json(spec.model_dump_json()) == spec
        assert isinstance(spec, DSecRunArgs)  # limits, TTL, labels ... are shared
        assert spec.memory_limit_mb == 512 and spec.ttl_running_stop == 300
    info = SandboxInfo(
        id="e1-" + "0" * 16,
        backend=BackendKind.MICROVM,
        state=SandboxState.CREATING,
        image=micro.image_ref,
        created_at=datetime.now(UTC),
        updated_at=datetime.now(UTC),
        edge="e1",
        spec=micro,
    )
    assert SandboxInfo.model_validate_json(info.model_dump_json()).spec == micro


@pytest.mark.parametrize(
    ("spec", "loc"),
    [
        ({"container_image": "busybox", "memory_limit_mb": 1}, ("spec", "memory_limit_mb")),
        ({"backend": "microvm", "container_image": "busybox"}, ("spec", "image")),
        ({"backend": "microvm", "image": "Not A Ref"}, ("spec", "image")),
        ({"backend": "fullvm", "vm_image": "x", "workspace": "w:1"}, ("spec", "workspace")),
        ({"backend": "container", "image": "busybox"}, ("spec", "container_image")),
        ({"backend": "fncall", "image": "busybox"}, ("spec",)),
        ({"backend": "nope"}, ("spec",)),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], loc: tuple[str, ...]) -> None:
    """Errors name the field as they always did (no union tag in the path)."""
    with pytest.raises(ValidationError) as err:
        CreateSandboxRequest.model_validate({"spec": spec})
    assert loc in [e["loc"] for e in err.value.errors()], err.value.errors()


@pytest.fixture
def unregistered_fullvm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind has a backend now: the fullvm row is taken out of the table the
    create path checks, so that a kind without one is still tested."""
    table = {k: v for k, v in BACKENDS.items() if k is not BackendKind.FULLVM}
    monkeypatch.setattr(kinds, "BACKENDS", table)


@pytest.mark.usefixtures("unregistered_fullvm")
def test_require_backend_narrows_or_refuses() -> None:
    for runnable in (
        DSecContainerRunArgs(container_image="busybox"),
        DSecMicroVMRunArgs(image="debian:12"),
    ):
        assert require_backend(runnable) is runnable
    for vm in (DSecFullVMRunArgs(vm_image="ubuntu:24"),):
        with pytest.raises(Unsupported) as err:
            require_backend(vm)
        assert err.value.status == 501 and err.value.details["backend"] == vm.backend
        assert repr(vm.backend) in err.value.message


def test_vm_classes_are_exported_from_dsec() -> None:
    assert dsec.DSecMicroVMRunArgs is DSecMicroVMRunArgs
    assert dsec.DSecFullVMRunArgs is DSecFullVMRunArgs
    assert {"DSecMicroVMRunArgs", "DSecFullVMRunArgs"} <= set(dsec.__all__)


# ---- edge.db -----------------------------------------------------------------------


def _insert(db_path: Path, sid: str, spec_json: str) -> None:
    con = sqlite3.connect(db_path)
    with con:
        con.execute(
            "INSERT INTO sandboxes (id, state, spec, image, created_at, updated_at, reason, "
            "runtime) VALUES (?, 'running', ?, ?, '2026-01-02T03:04:05+00:00', "
            "'2026-01-02T03:04:06+00:00', NULL, '{}')",
            (sid, spec_json, OLD_IMAGE_ROW),
        )
    con.close()


def test_edge_db_rows_of_the_previous_release_still_load(tmp_path: Path) -> None:
    db = EdgeStateDB(tmp_path / "edge.db")
    try:
        _insert(tmp_path / "edge.db", "e1-" + "a" * 16, OLD_SPEC_ROW)
        # and one without the backend field at all
        _insert(tmp_path / "edge.db", "e1-" + "b" * 16, '{"container_image":"busybox"}')
        loaded = {r.id: r for r in db.load("e1")}
    finally:
        db.close()
    old = loaded["e1-" + "a" * 16]
    assert isinstance(old.spec, DSecContainerRunArgs) and old.spec == _old_spec()
    assert old.state is SandboxState.RUNNING and old.image.layers == ["sha256:" + "b" * 64]
    assert old.info().image == "busybox:latest" and old.info().backend is BackendKind.CONTAINER
    bare = loaded["e1-" + "b" * 16].spec
    assert isinstance(bare, DSecContainerRunArgs) and bare.container_image == "busybox"


def test_edge_db_keeps_a_vm_spec(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    image = ImageInfo.model_validate_json(OLD_IMAGE_ROW)
    spec = DSecMicroVMRunArgs(image="debian:12", toolkit=LayerRef("tools", "v1"))
    rec = SandboxRecord(
        id="e1-" + "c" * 16,
        spec=spec,
        image=image,
        state=SandboxState.CREATING,
        created_at=now,
        updated_at=now,
        edge="e1",
    )
    db = EdgeStateDB(tmp_path / "edge.db")
    try:
        db.save(rec)
        (loaded,) = db.load("e1")
    finally:
        db.close()
    assert loaded.spec == spec and isinstance(loaded.spec, DSecMicroVMRunArgs)
    assert loaded.info().backend is BackendKind.MICROVM and loaded.info().image == "debian:12"


# ---- 501 on every create path --------------------------------------------------------

# Kinds with no backend yet (the microvm backend exists: tests/test_microvm_*.py).
VM_SPECS: list[RunArgs] = [DSecFullVMRunArgs(vm_image="busybox")]


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app, edge, engine = await make_fake_app(tmp_path / "keys.db")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, edge
    await engine.dispose()


@pytest.mark.parametrize("spec", VM_SPECS, ids=lambda s: s.backend)
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "idempotency-key"])
@pytest.mark.usefixtures("unregistered_fullvm")
async def test_create_route_answers_501_for_vm_kinds(
    http: tuple[httpx.AsyncClient, Any], spec: RunArgs, keyed: bool
) -> None:
    client, edge = http
    headers = {**AUTH, "Idempotency-Key": "k-1"} if keyed else AUTH
    body = {"spec": spec.model_dump(mode="json"), "timeout": 10}
    r = await client.post("/v1/sandboxes", json=body, headers=headers)
    assert r.status_code == 501, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported" and err["details"]["backend"] == spec.backend
    assert spec.backend in err["message"]
    assert edge.boxes == {}  # nothing was created


@pytest.mark.usefixtures("unregistered_fullvm")
async def test_batch_of_vms_answers_501_before_it_starts(
    http: tuple[httpx.AsyncClient, Any],
) -> None:
    client, edge = http
    req = CreateBatchRequest(spec=VM_SPECS[0], count=3, job="job-1")
    r = await client.post("/v1/batches", json=req.model_dump(mode="json"), headers=AUTH)
    assert r.status_code == 501, r.text
    assert r.json()["error"]["details"]["backend"] == "fullvm"
    assert edge.boxes == {}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path_factory.mktemp("specs") / "keys.db").start()
    yield server
    server.stop()


@pytest.mark.parametrize("spec", VM_SPECS, ids=lambda s: s.backend)
@pytest.mark.usefixtures("unregistered_fullvm")
async def test_sdk_raises_unsupported_typed(live: LiveServer, spec: RunArgs) -> None:
    async with DSecClient(live.url, KEY) as client:
        with pytest.raises(Unsupported) as err:
            await client.run_sandbox(spec, timeout=10)
        assert err.value.details["backend"] == spec.backend
        # a container spec through the same call still runs
        sb = await client.run_sandbox(DSecContainerRunArgs(container_image="busybox"))
        assert sb.info.backend is BackendKind.CONTAINER
        await sb.stop()


@pytest.mark.parametrize("spec", VM_SPECS, ids=lambda s: s.backend)
@pytest.mark.usefixtures("unregistered_fullvm")
def test_sync_sdk_raises_unsupported_typed(live: LiveServer, spec: RunArgs) -> None:
    with DSecSyncClient(live.url, KEY) as client, pytest.raises(Unsupported) as err:
        client.run_sandbox(spec, timeout=10)
    assert err.value.details["backend"] == spec.backend


# ---- the edge's own check ------------------------------------------------------------


class _UntouchedBackend(Backend):
    """A backend that fails the test if the edge reaches it."""

    kind = BackendKind.CONTAINER

    @classmethod
    def from_host(cls, host: BackendHost) -> _UntouchedBackend:
        return cls()

    async def create(self, inp: CreateInput) -> BackendFacts:
        raise AssertionError("the edge reached the backend")

    async def destroy(self, rec: SandboxRecord) -> None:
        raise AssertionError("the edge reached the backend")

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        raise AssertionError("the edge reached the backend")

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        raise AssertionError("the edge reached the backend")

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        raise AssertionError("the edge reached the backend")

    async def is_alive(self, rec: SandboxRecord) -> bool:
        raise AssertionError("the edge reached the backend")

    async def still_running(self, rec: SandboxRecord) -> bool:
        raise AssertionError("the edge reached the backend")

    async def sweep(self, known_ids: set[str]) -> list[str]:
        return []

    def check_limits(self, spec: RunArgs) -> None:
        raise AssertionError("the edge checked limits of a spec it cannot run")


@pytest.mark.parametrize("spec", VM_SPECS, ids=lambda s: s.backend)
async def test_edge_refuses_a_vm_spec_before_any_work(tmp_path: Path, spec: RunArgs) -> None:
    """Reached directly (cluster mode: the apiserver's RemoteEdge posts to it)."""
    state = EdgeStateDB(tmp_path / "edge.db")
    edge = Edge(
        edge_id="e1",
        backends=[_UntouchedBackend()],
        images=FakeImages(),
        state=state,
        admission=Admission(max_sandboxes=4, memory_overcommit=1.0),
    )
    try:
        with pytest.raises(Unsupported) as err:
            await edge.create(spec, timeout=10)
        assert err.value.details["backend"] == spec.backend
        claim = IdempotencyClaim.of("alice\nrl", "k-1", spec)
        with pytest.raises(Unsupported):
            await edge.create_keyed(spec, timeout=10, claim=claim)
        assert await edge.replay(claim, timeout=1) is None  # the key is free again
        assert state.load("e1") == [] and edge.admission.count == 0
    finally:
        state.close()
