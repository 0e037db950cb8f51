"""The backend conformance suite: the same tests for every backend with a harness
(tests/conformance/conftest.py), through a real Edge: create, exec, files, idle TTL,
stop, recovery after an edge restart, a failed request that must leave a live or
held-still sandbox alone, capability refusals, admission limits, audit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from dsec import linux
from dsec.api.events import AuditKind
from dsec.api.exec import ExecRequest, SessionArgs
from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind
from dsec.api.verify import VerifyRequest
from dsec.backends.base import Capability
from dsec.edge.dataplane import DataPlane
from dsec.edge.tokens import TokenSigner
from dsec.errors import (
    AdmissionRejected,
    BackendError,
    FileNotFound,
    SandboxNotRunning,
    Unsupported,
)
from dsec.security import protected
from tests.conformance.conftest import Harness
from tests.waiting import until


async def test_create_and_exec(harness: Harness) -> None:
    edge = await harness.edge()
    info = await edge.create(harness.make_spec(), timeout=harness.create_timeout)
    assert info.state is SandboxState.RUNNING and info.backend is harness.kind
    ok = await edge.exec(info.id, ExecRequest(command=["echo", "hello", "world"]))
    assert (ok.exit_code, ok.stdout) == (0, "hello world\n")
    assert (await edge.exec(info.id, ExecRequest(command="false"))).exit_code == 1
    assert (await edge.exec(info.id, ExecRequest(command="exit 7"))).exit_code == 7
    missing = await edge.exec(info.id, ExecRequest(command="no-such-tool"))
    assert missing.exit_code == 127 and "not found" in missing.stderr
    # What runs a VM is said where a caller and an operator look: the sandbox and health.
    health = await edge.health()
    if harness.kind in (BackendKind.MICROVM, BackendKind.FULLVM):
        assert info.accelerator in ("kvm", "tcg")
        details = health.backend_details[harness.kind.value]
        assert details["accelerator"] == info.accelerator
        assert details["accelerator_reason"]
    else:
        assert info.accelerator is None


async def test_files_round_trip_and_are_seen_by_commands(harness: Harness) -> None:
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    await edge.write_file(sid, "/tmp/a.txt", b"payload\n")
    assert await edge.read_file(sid, "/tmp/a.txt", max_bytes=100) == b"payload\n"
    assert (await edge.exec(sid, ExecRequest(command="cat /tmp/a.txt"))).stdout == "payload\n"
    with pytest.raises(FileNotFound) as err:
        await edge.read_file(sid, "/tmp/missing", max_bytes=100)
    assert err.value.status == 404


async def test_idle_ttl_stops_the_sandbox(harness: Harness) -> None:
    edge = await harness.edge()
    idle = (
        await edge.create(harness.make_spec(ttl_running_stop=1), timeout=harness.create_timeout)
    ).id
    kept = (
        await edge.create(harness.make_spec(ttl_running_stop=None), timeout=harness.create_timeout)
    ).id
    for _ in range(100):
        if (await edge.get(idle)).state.terminal:
            break
        await asyncio.sleep(0.05)
    assert (await edge.get(idle)).state is SandboxState.STOPPED
    assert (await edge.get(kept)).state is SandboxState.RUNNING


async def test_stop_is_idempotent_and_ends_the_sandbox(harness: Harness) -> None:
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    first = await edge.stop(sid)
    second = await edge.stop(sid)
    assert first.state is second.state is SandboxState.STOPPED
    assert edge.admission.count == 0
    with pytest.raises(SandboxNotRunning):  # a stopped sandbox runs nothing
        await edge.exec(sid, ExecRequest(command="true"))


async def test_an_edge_restart_re_adopts_running_sandboxes(harness: Harness) -> None:
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    await edge.write_file(sid, "/state", b"kept")
    dies = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    stopped = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    await edge.stop(stopped)
    edge = await harness.restart(edge)
    assert set(harness.last_recovery["adopted"]) == {sid, dies}
    assert (await edge.exec(sid, ExecRequest(command="cat /state"))).stdout == "kept"
    assert edge.admission.count == 2  # adopted sandboxes count against the host again
    assert (await edge.get(stopped)).state is SandboxState.STOPPED
    # One dies while the edge is down: the next start finds it lost, not adopted.
    edge = await harness.restart(edge, while_down=lambda: harness.kill(dies))
    assert harness.last_recovery["adopted"] == [sid]
    assert harness.last_recovery["lost"] == [dies]
    assert (await edge.get(dies)).state is SandboxState.FAILED
    assert edge.admission.count == 1


async def _failing_read(*_args: object, **_kw: object) -> bytes:
    """A backend's ``read_file`` that fails the way a broken agent link does."""
    raise BackendError("injected: the agent link failed this one request")


async def test_a_failed_request_leaves_a_live_sandbox_and_its_work_alone(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that fails with a BackendError makes the edge ask the backend whether
    the sandbox still runs (``still_running``). Asking must disturb nothing: a command
    in flight finishes, the sandbox stays RUNNING and serves, and only the one request
    fails. (The microVM backend once answered with its restart adoption: a new
    tracked VM and agent link, which broke the command in flight and, during a verify,
    continued the held VM and killed its verifier.)"""
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    rec = edge.find(sid)
    assert rec is not None
    backend = edge.backend_of(rec)
    # The memory backend's toy shell has no sleep and runs a command at once.
    command = "echo done" if harness.kind is BackendKind.MEMORY else "sleep 2; echo done"
    slow = asyncio.create_task(edge.exec(sid, ExecRequest(command=command)))
    await asyncio.sleep(0.5)

    with monkeypatch.context() as m:
        m.setattr(backend, "read_file", _failing_read)
        for _ in range(3):
            with pytest.raises(BackendError, match="injected"):
                await edge.read_file(sid, "/etc/hostname", max_bytes=100)
    assert (await slow).stdout == "done\n"
    assert (await edge.get(sid)).state is SandboxState.RUNNING
    assert (await edge.exec(sid, ExecRequest(command="echo fine"))).stdout == "fine\n"
    assert await backend.still_running(rec)
    await edge.stop(sid)
    assert not await backend.still_running(rec)


@contextlib.contextmanager
def held_still(harness: Harness, backend: Any, rec: Any) -> Iterator[Callable[[], bool]]:
    """Hold a sandbox still the way a verify or pack step does (a container's cgroup
    frozen, a VM's QEMU stopped); yields a check that it is still held."""
    if harness.kind is BackendKind.CONTAINER:
        rel = backend.cgroup_of(rec.id)
        protected.freeze(backend.cgroups, rel)
        try:
            yield lambda: protected.is_frozen(backend.cgroups, rel)
        finally:
            protected.thaw(backend.cgroups, rel)
    elif harness.kind in (BackendKind.MICROVM, BackendKind.FULLVM):
        pid = rec.facts.init_pid
        os.kill(pid, signal.SIGSTOP)
        until(f"QEMU {pid} stopped", lambda: _stopped(pid), 5, interval=0.01)
        try:
            yield lambda: _stopped(pid)
        finally:
            os.kill(pid, signal.SIGCONT)
    else:  # the memory backend has nothing to hold
        yield lambda: True


def _stopped(pid: int) -> bool:
    st = linux.proc_stat(pid)
    return st is not None and st.stopped


async def test_a_failed_request_on_a_held_sandbox_keeps_it_held_and_running(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same question while the sandbox is held still by a step of this process: a
    held sandbox is a live one (a container's runtime calls it "paused"; its agent
    cannot answer a ping until thawed), and asking must not release the hold. The old
    answer ran the crashed-verify recovery, which thawed a container or continued a VM
    that a verify or pack was reading."""
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    rec = edge.find(sid)
    assert rec is not None
    backend = edge.backend_of(rec)

    with held_still(harness, backend, rec) as still_held, monkeypatch.context() as m:
        m.setattr(backend, "read_file", _failing_read)
        with pytest.raises(BackendError, match="injected"):
            await edge.read_file(sid, "/etc/hostname", max_bytes=100)
        assert still_held()
        assert (await edge.get(sid)).state is SandboxState.RUNNING
    assert (await edge.exec(sid, ExecRequest(command="echo fine"))).stdout == "fine\n"


async def test_missing_capabilities_are_refused_before_any_work(harness: Harness) -> None:
    edge = await harness.edge()
    backend = edge.backend_for(harness.kind)
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    checks: list[tuple[Capability, Coroutine[Any, Any, object]]] = []
    if Capability.VERIFY not in backend.capabilities:
        checks.append((Capability.VERIFY, edge.verify(sid, VerifyRequest(command="true"))))
    if Capability.PACK not in backend.capabilities:
        checks.append((Capability.PACK, edge.pack_diff(sid, "env", "1")))
    if Capability.SESSIONS not in backend.capabilities:
        plane = DataPlane(edge, TokenSigner(b"k" * 32), "http://e1:8471")
        checks.append((Capability.SESSIONS, plane.open_session(sid, SessionArgs())))
    if Capability.DISK_LIMIT not in backend.capabilities:
        spec = harness.make_spec(disk_limit_mb=64)
        checks.append((Capability.DISK_LIMIT, edge.create(spec, timeout=harness.create_timeout)))
    if not checks:
        pytest.skip(f"the {harness.kind.value} backend has every capability checked here")
    for capability, call in checks:
        with pytest.raises(Unsupported) as err:
            await call
        assert err.value.status == 501
        assert err.value.details == {"backend": harness.kind.value, "capability": capability}
    assert [r.id for r in await edge.list()] == [sid]  # the refused create made nothing
    assert edge.admission.count == 1


async def test_admission_refuses_past_max_sandboxes(harness: Harness) -> None:
    harness.max_sandboxes = 2
    edge = await harness.edge()
    first = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    await edge.create(harness.make_spec(), timeout=harness.create_timeout)
    with pytest.raises(AdmissionRejected) as err:
        await edge.create(harness.make_spec(), timeout=harness.create_timeout)
    assert err.value.status == 503
    await edge.stop(first)
    assert (
        await edge.create(harness.make_spec(), timeout=harness.create_timeout)
    ).state is SandboxState.RUNNING


async def test_exec_is_audited(harness: Harness) -> None:
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    await edge.exec(sid, ExecRequest(command=["echo", "audited"]))
    harness.audit.flush()
    rows = harness.audit.records(kinds=[AuditKind.COMMAND], sandbox_id=sid)
    assert [r.action for r in rows] == ["exec"]
    assert "audited" in str(rows[0].detail)
