"""The backend registry (dsec.backends.registry) and the edge's use of it: classes are
imported on first use, probed, selected; a request that needs a capability the
sandbox's backend lacks, or a sandbox of a kind no backend runs here, is refused with
Unsupported (501) naming backend and capability, before any work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from dsec.api.exec import ExecRequest, ExecResult, SessionArgs
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind, DSecContainerRunArgs
from dsec.api.verify import VerifyRequest
from dsec.backends.base import (
    Backend,
    BackendFacts,
    BackendHost,
    Capability,
    CreateInput,
    SandboxRecord,
    StoredFacts,
)
from dsec.backends.registry import BACKENDS, BackendRegistry
from dsec.cluster.node import EdgeNode
from dsec.control.placement import Demand, EdgeView, Placer
from dsec.edge.admission import Admission
from dsec.edge.dataplane import DataPlane
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.edge.tokens import TokenSigner
from dsec.errors import ClusterFull, InvalidArgument, Unsupported
from dsec.security.audit import AuditLog

SID = "e1-0123456789abcdef"


class MinimalBackend(Backend):
    """A backend with no optional capability at all; records every call it gets."""

    kind = BackendKind.CONTAINER
    reason: str | None = None  # what probe() answers

    def __init__(self) -> None:
        self.calls: list[str] = []

    @classmethod
    def probe(cls) -> str | None:
        return cls.reason

    @classmethod
    def from_host(cls, host: BackendHost) -> MinimalBackend:
        return cls()

    async def create(self, inp: CreateInput) -> BackendFacts:
        self.calls.append("create")
        return StoredFacts()

    async def destroy(self, rec: SandboxRecord) -> None:
        self.calls.append("destroy")

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        self.calls.append("exec")
        return ExecResult(exit_code=0, stdout="", stderr="", duration=0.0)

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        self.calls.append("read_file")
        return b""

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        self.calls.append("write_file")

    async def is_alive(self, rec: SandboxRecord) -> bool:
        return True

    async def still_running(self, rec: SandboxRecord) -> bool:
        return True

    async def sweep(self, known_ids: set[str]) -> list[str]:
        return []


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


PLUGIN = """
    from tests.test_backend_registry import MinimalBackend

    class Plugin(MinimalBackend):
        pass
"""


def test_the_container_backend_is_imported_on_first_use_only() -> None:
    """Importing the registry (what the edge does) imports no backend module; load()
    does, and returns the class the table names."""
    code = textwrap.dedent(
        """
        import sys
        from dsec.backends.registry import BackendRegistry
        from dsec.api.spec import BackendKind
        mod = "dsec.backends.container.backend"
        assert mod not in sys.modules, "imported eagerly"
        cls = BackendRegistry().load(BackendKind.CONTAINER)
        assert mod in sys.modules and cls.__module__ == mod, cls
        print(cls.__name__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "ContainerBackend"
    assert BACKENDS[BackendKind.CONTAINER].endswith(":ContainerBackend")


def test_load_is_lazy_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, monkeypatch, "dsec_test_plugin", PLUGIN)
    registry = BackendRegistry({BackendKind.CONTAINER: "dsec_test_plugin:Plugin"})
    assert "dsec_test_plugin" not in sys.modules
    cls = registry.load(BackendKind.CONTAINER)
    assert cls.__name__ == "Plugin" and "dsec_test_plugin" in sys.modules
    assert registry.load(BackendKind.CONTAINER) is cls


def test_a_kind_without_a_backend_is_unsupported_naming_the_kind() -> None:
    registry = BackendRegistry({})
    with pytest.raises(Unsupported) as err:
        registry.load(BackendKind.MICROVM)
    assert err.value.status == 501
    assert err.value.details == {"backend": "microvm"}
    assert "microvm" in err.value.message
    assert registry.probe(BackendKind.MICROVM) == err.value.message


def test_default_selection_is_every_backend_that_probes_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One backend that probes ok, one whose probe fails, one whose module does not
    import: only the first is enabled, the others are reported with why."""
    _module(tmp_path, monkeypatch, "dsec_test_ok", PLUGIN)
    _module(
        tmp_path,
        monkeypatch,
        "dsec_test_no_kvm",
        """
        from dsec.api.spec import BackendKind
        from tests.test_backend_registry import MinimalBackend

        class NoKVM(MinimalBackend):
            kind = BackendKind.MICROVM
            reason = "no usable /dev/kvm"
        """,
    )
    registry = BackendRegistry(
        {
            BackendKind.CONTAINER: "dsec_test_ok:Plugin",
            BackendKind.MICROVM: "dsec_test_no_kvm:NoKVM",
            BackendKind.FULLVM: "dsec_test_missing_module:FullVM",
        }
    )
    got = registry.select(None)
    assert got.enabled == (BackendKind.CONTAINER,)
    assert got.unavailable[BackendKind.MICROVM] == "no usable /dev/kvm"
    assert "cannot import the fullvm backend" in got.unavailable[BackendKind.FULLVM]
    host: Any = None  # MinimalBackend.from_host needs nothing of the host
    (built,) = registry.build(got, host)
    assert type(built).__name__ == "Plugin"


def test_explicit_selection_refuses_unknown_and_unavailable_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(
        tmp_path,
        monkeypatch,
        "dsec_test_broken",
        """
        from tests.test_backend_registry import MinimalBackend

        class Broken(MinimalBackend):
            reason = "no crun on PATH"
        """,
    )
    registry = BackendRegistry({BackendKind.CONTAINER: "dsec_test_broken:Broken"})
    with pytest.raises(InvalidArgument, match="unknown backend 'kvm'"):
        registry.select(["kvm"])
    with pytest.raises(Unsupported) as err:
        registry.select(["container"])
    assert err.value.details == {"backend": "container", "reason": "no crun on PATH"}
    with pytest.raises(InvalidArgument, match="at least one"):
        registry.select([])


def test_a_class_of_another_kind_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "dsec_test_wrong_kind", PLUGIN)
    registry = BackendRegistry({BackendKind.FULLVM: "dsec_test_wrong_kind:Plugin"})
    with pytest.raises(TypeError, match="runs container sandboxes, not fullvm"):
        registry.load(BackendKind.FULLVM)


def test_the_container_backend_declares_its_capabilities() -> None:
    cls = BackendRegistry().load(BackendKind.CONTAINER)
    assert Capability.VERIFY in cls.capabilities
    assert Capability.PAUSE in cls.capabilities
    assert Capability.SNAPSHOT not in cls.capabilities  # snapshot() raises Unsupported
    with pytest.raises(Unsupported) as err:
        cls.require(Capability.SNAPSHOT)
    assert err.value.details == {"backend": "container", "capability": "snapshot"}


# -- the edge -----------------------------------------------------------------------------
@pytest.fixture
def edge_with(tmp_path: Path) -> Iterator[tuple[Edge, MinimalBackend]]:
    """A real Edge whose only backend supports nothing optional, with one running
    sandbox (no image service: any work past the refusal would fail loudly)."""
    backend = MinimalBackend()
    state = EdgeStateDB(tmp_path / "edge.db")
    edge = Edge(
        edge_id="e1",
        backends=[backend],
        images=None,  # type: ignore[arg-type]
        state=state,
        admission=Admission(max_sandboxes=4, memory_overcommit=1.0),
        audit=AuditLog(None),
        unavailable={BackendKind.MICROVM: "no usable /dev/kvm"},
    )
    now = datetime.now(UTC)
    rec = SandboxRecord(
        id=SID,
        spec=DSecContainerRunArgs(container_image="busybox", job_id="job-1"),
        image=ImageInfo(
            name="busybox", tag="latest", digest="sha256:0", layers=[], size_bytes=0, created_at=now
        ),
        state=SandboxState.RUNNING,
        created_at=now,
        updated_at=now,
        edge="e1",
    )
    state.save(rec)
    edge._records[rec.id] = rec
    try:
        yield edge, backend
    finally:
        state.close()


def _refused(err: pytest.ExceptionInfo[Unsupported], capability: Capability) -> None:
    assert err.value.status == 501 and err.value.code == "unsupported"
    assert err.value.details == {"backend": "container", "capability": capability.value}
    assert "container" in err.value.message and capability.value in err.value.message


async def test_data_path_requests_need_their_capability(
    edge_with: tuple[Edge, MinimalBackend],
) -> None:
    edge, backend = edge_with
    with pytest.raises(Unsupported) as err:
        await edge.read_file(SID, "/etc/hostname", max_bytes=10)
    _refused(err, Capability.FILES)
    with pytest.raises(Unsupported) as err:
        await edge.write_file(SID, "/tmp/x", b"x")
    _refused(err, Capability.FILES)
    with pytest.raises(Unsupported) as err:
        await edge.verify(SID, VerifyRequest(command="true"))
    _refused(err, Capability.VERIFY)
    with pytest.raises(Unsupported) as err:
        await edge.update_network(SID, {"pypi": True})
    _refused(err, Capability.NETWORK_RULES)
    with pytest.raises(Unsupported) as err:
        await edge.pack_diff(SID, "env", "1")
    _refused(err, Capability.PACK)
    report = await edge.pause_job("job-1")  # per sandbox: reported, not raised
    assert report.paused == 0 and "pause" in (report.sandboxes[0].error or "")
    assert backend.calls == []  # nothing reached the backend
    # What it can do still works.
    assert (await edge.exec(SID, ExecRequest(command="true"))).exit_code == 0
    assert backend.calls == ["exec"]


async def test_sessions_need_the_sessions_capability(
    edge_with: tuple[Edge, MinimalBackend],
) -> None:
    """The data plane (sessions, processes, streams) asks for the backend's agent only
    through the capability check."""
    edge, backend = edge_with
    plane = DataPlane(edge, TokenSigner(b"k" * 32), "http://e1:8471")
    with pytest.raises(Unsupported) as err:
        await plane.open_session(SID, SessionArgs())
    _refused(err, Capability.SESSIONS)
    assert backend.calls == []


@pytest.mark.parametrize(
    ("spec", "capability"),
    [
        ({"network_rules": {"pypi": True}}, Capability.NETWORK_RULES),
        ({"disk_limit_mb": 64}, Capability.DISK_LIMIT),
        ({"protected": [{"path": "/grader", "files": {"a": "b"}}]}, Capability.PROTECTED_PATHS),
    ],
)
async def test_create_needing_a_missing_capability_is_refused_before_any_work(
    edge_with: tuple[Edge, MinimalBackend], spec: dict[str, Any], capability: Capability
) -> None:
    edge, backend = edge_with
    with pytest.raises(Unsupported) as err:
        await edge.create(DSecContainerRunArgs(container_image="busybox", **spec), timeout=5)
    _refused(err, capability)
    assert backend.calls == [] and len(await edge.list()) == 1  # no record was made


async def test_a_kind_no_backend_runs_here_is_unsupported_naming_it(tmp_path: Path) -> None:
    state = EdgeStateDB(tmp_path / "edge.db")
    edge = Edge(
        edge_id="e1",
        backends=[],
        images=None,  # type: ignore[arg-type]
        state=state,
        admission=Admission(max_sandboxes=4, memory_overcommit=1.0),
        audit=AuditLog(None),
        unavailable={BackendKind.CONTAINER: "no crun on PATH"},
    )
    try:
        with pytest.raises(Unsupported) as err:
            await edge.create(DSecContainerRunArgs(container_image="busybox"), timeout=5)
        assert err.value.status == 501
        assert err.value.details == {"backend": "container"}
        assert "no container sandboxes (no crun on PATH)" in err.value.message
        health = await edge.health()
        assert health.backends == [] and health.backends_unavailable == {
            "container": "no crun on PATH"
        }
    finally:
        state.close()


async def test_health_and_heartbeat_report_the_probed_backends(
    edge_with: tuple[Edge, MinimalBackend],
) -> None:
    edge, _ = edge_with
    health = await edge.health()
    assert health.backends == ["container"]
    assert health.backends_unavailable == {"microvm": "no usable /dev/kvm"}

    class NoImages:
        async def list(self) -> list[Any]:
            return []

    node = EdgeNode(edge, NoImages(), join=[], token="t", url="http://e1:8471")  # type: ignore[arg-type]
    report = await node.report()
    assert report.backends == ["container"]
    edge.backends.clear()  # an edge that runs nothing advertises nothing
    assert (await node.report()).backends == []


def test_placement_filters_on_the_reported_backends() -> None:
    views = [
        EdgeView("e0", "http://e0:8471", capacity=4, backends=frozenset()),
        EdgeView("e1", "http://e1:8471", capacity=4, backends=frozenset({"container"})),
    ]
    placer = Placer()
    placer.update(views)
    got = placer.candidates(Demand(backend=BackendKind.CONTAINER.value), n=2)
    assert [v.edge_id for v in got] == ["e1"]
    with pytest.raises(ClusterFull):
        placer.candidates(Demand(backend=BackendKind.MICROVM.value))


async def test_best_effort_qos_needs_the_qos_capability(
    edge_with: tuple[Edge, MinimalBackend],
) -> None:
    """A backend that cannot run a sandbox at SCHED_IDLE refuses a best_effort spec with
    a typed 501 before any work: never a silent latency-class sandbox."""
    edge, backend = edge_with
    spec = DSecContainerRunArgs(container_image="busybox", qos="best_effort")
    with pytest.raises(Unsupported) as err:
        await edge.create(spec, timeout=5)
    _refused(err, Capability.QOS)
    assert backend.calls == []


def test_qos_capability_of_each_backend() -> None:
    """Every backend enforces best_effort (containers: each process; the VMs: their
    QEMU's threads), so a run spec's class holds whatever the backend."""
    registry = BackendRegistry()
    for kind in (BackendKind.CONTAINER, BackendKind.MICROVM, BackendKind.FULLVM):
        assert Capability.QOS in registry.load(kind).capabilities
