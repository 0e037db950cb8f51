"""Harnesses for the backend conformance suite, one per registered backend: the
memory backend on a bare Edge (a real EdgeStateDB and AuditLog, no image service, no
root), the container, microVM and full-VM backends through the platform's own
composition root (root; the full VMs boot the project's small VM image).

A harness builds the edge afresh on the same state, so a test can close an edge
without stopping its sandboxes and start another that must re-adopt them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dsec.api.spec import (
    BackendKind,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMemoryRunArgs,
    DSecMicroVMRunArgs,
    RunArgs,
)
from dsec.backends.base import Backend
from dsec.backends.memory.backend import MemoryBackend
from dsec.backends.memory.world import MemoryWorld
from dsec.config import PlatformConfig
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.guest.vmimage import busybox_vm_image
from dsec.images.service import ImageService
from dsec.roots.platform import running_platform
from dsec.security.audit import AuditLog
from tests.conftest import clean_leftovers, host_leaks


@dataclass
class Harness:
    """One backend under test, and the edges built around it."""

    kind: BackendKind
    make_backend: Callable[[], Backend]
    make_spec: Callable[..., RunArgs]
    kill: Callable[[str], object]  # a sandbox dies behind the edge's back
    state_dir: Path
    max_sandboxes: int = 4
    create_timeout: float = 10
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


@dataclass
class PlatformHarness(Harness):
    """A backend as ``dsec up`` wires it (dsec.roots.platform, in this process: real
    crun or QEMU, cgroups, EROFS layers, the spawner), only that backend enabled,
    busybox built. A restart leaves the sandboxes running, as a SIGTERM does, and the
    next start re-adopts them; everything the platform made is removed at the end,
    also on failure."""

    # What the platform needs besides busybox before a sandbox of this kind starts
    # (the fullvm kind: a VM image imported).
    prepare: Callable[[Any], Awaitable[None]] | None = None
    _stack: contextlib.AsyncExitStack | None = None
    _config: PlatformConfig | None = None
    _pids: dict[str, int] = field(default_factory=dict)
    _base: Path | None = None

    async def edge(self, *, stop_on_close: bool = True) -> Edge:
        if self._config is None:
            # A short data dir: agent sockets live under it (unix socket path limit).
            self._base = Path(tempfile.mkdtemp(prefix="dsec-cf-", dir="/tmp"))
            self._config = PlatformConfig(
                data_dir=self._base / "d",
                edge_id="c" + secrets.token_hex(4),
                max_sandboxes=self.max_sandboxes,
                sandbox_disk_gb=1,
                stop_sandboxes_on_exit=True,
                backends=[self.kind.value],
            )
        self._config.stop_sandboxes_on_exit = stop_on_close
        self._stack = contextlib.AsyncExitStack()
        platform = await self._stack.enter_async_context(running_platform(self._config))
        await platform.images.build("busybox")
        if self.prepare is not None:
            await self.prepare(platform)
        edge = platform.edge
        edge.ttl_interval = 0.05
        self.audit = edge.audit
        self.last_recovery = platform.recovery
        self.edges.append(edge)
        return edge

    async def restart(self, edge: Edge, *, while_down: Callable[[], object] = lambda: None) -> Edge:
        assert self._stack is not None and self._config is not None
        self._pids = {
            r.id: r.facts.init_pid
            for r in (edge.find(i.id) for i in await edge.list())
            if r is not None and r.facts.init_pid is not None
        }
        self._config.stop_sandboxes_on_exit = False
        await self._stack.aclose()
        self.edges.remove(edge)
        while_down()
        return await self.edge()

    def kill_init(self, sandbox_id: str) -> None:
        """SIGKILL the sandbox's init from the host (while the edge is down)."""
        os.kill(self._pids[sandbox_id], signal.SIGKILL)

    async def close(self) -> None:
        try:
            if self._stack is not None and self._config is not None:
                self._config.stop_sandboxes_on_exit = True
                await self._stack.aclose()
        finally:
            leaks: list[str] = []
            if self._config is not None:
                leaks = host_leaks(self._config.data_dir, self._config.edge_id)
                clean_leftovers(self._config.data_dir, self._config.edge_id)
            if self._base is not None:
                shutil.rmtree(self._base, ignore_errors=True)
            assert not leaks, f"the platform left these behind: {leaks}"


def _container(tmp_path: Path) -> Harness:
    h = PlatformHarness(
        kind=BackendKind.CONTAINER,
        make_backend=lambda: pytest.fail("built by the platform root"),
        make_spec=lambda **kw: DSecContainerRunArgs(
            container_image="busybox:latest", memory_limit_mb=64, **kw
        ),
        kill=lambda sid: None,
        state_dir=tmp_path,
    )
    h.kill = h.kill_init
    return h


def _microvm(tmp_path: Path) -> Harness:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/install.sh installs it)")
    h = PlatformHarness(
        kind=BackendKind.MICROVM,
        make_backend=lambda: pytest.fail("built by the platform root"),
        make_spec=lambda **kw: DSecMicroVMRunArgs(
            image="busybox:latest", memory_limit_mb=256, disk_limit_mb=256, **kw
        ),
        kill=lambda sid: None,
        state_dir=tmp_path,
        # A boot under TCG (no usable KVM here) takes seconds, not milliseconds.
        create_timeout=60,
    )
    h.kill = h.kill_init
    return h


FULLVM_IMAGE = "fvm-conformance:1"


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    fh = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(fh.read, 4 << 20):
            yield chunk
    finally:
        fh.close()


async def import_test_vm(images: ImageService, ref: str) -> None:
    """The project's small VM image (dsec.guest.vmimage) under ``ref``, imported as a
    user would (each file a blob, then tagged); also used by bench/bench_fullvm.py."""
    files = await asyncio.to_thread(busybox_vm_image)
    disk, kernel, initrd = [
        (await images.add_vm_blob(_file_chunks(path)))[0]
        for path in (files.disk, files.kernel, files.initrd)
    ]
    await images.register_vm(ref, disk, kernel=kernel, initrd=initrd, cmdline=files.cmdline)


async def _import_test_vm(platform: Any) -> None:
    await import_test_vm(platform.images, FULLVM_IMAGE)


def _fullvm(tmp_path: Path) -> Harness:
    if shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None:
        pytest.skip("QEMU is not installed (scripts/install.sh installs it)")
    h = PlatformHarness(
        kind=BackendKind.FULLVM,
        make_backend=lambda: pytest.fail("built by the platform root"),
        make_spec=lambda **kw: DSecFullVMRunArgs(vm_image=FULLVM_IMAGE, memory_limit_mb=256, **kw),
        kill=lambda sid: None,
        state_dir=tmp_path,
        create_timeout=120,  # q35 under TCG: seconds to the guest agent
        prepare=_import_test_vm,
    )
    h.kill = h.kill_init
    return h


# Every kind with a harness: the memory backend in-process, the container backend
# through the platform's own root (needs root, crun, cgroups: our CI runs as root).
HARNESSES: dict[BackendKind, Callable[[Path], Harness]] = {
    BackendKind.MEMORY: _memory,
    BackendKind.CONTAINER: _container,
    BackendKind.MICROVM: _microvm,
    BackendKind.FULLVM: _fullvm,
}


@pytest.fixture(params=sorted(HARNESSES), ids=lambda k: k.value)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    h = HARNESSES[request.param](tmp_path)
    try:
        yield h
    finally:
        await h.close()
