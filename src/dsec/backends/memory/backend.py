"""The in-memory backend: a real ``Backend`` whose sandboxes are Python objects.

It exists so the edge's state machine (create, exec, files, TTLs, stop, restart and
re-adopt, capability refusals, admission, audit) can be tested, and the backend
conformance suite (tests/conformance) run, without root, crun or images. It is never
enabled by accident on a real host: its probe refuses unless ``DSEC_TEST_BACKENDS``
names it (comma-separated, e.g. ``DSEC_TEST_BACKENDS=memory``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.spec import BackendKind
from dsec.backends.base import (
    Backend,
    BackendFacts,
    BackendHost,
    Capability,
    CreateInput,
    SandboxRecord,
)
from dsec.backends.memory import commands
from dsec.backends.memory.world import WORLD, MemorySandbox, MemoryWorld
from dsec.errors import BackendError, FileNotFound, LimitExceeded

ENV = "DSEC_TEST_BACKENDS"


@dataclass(frozen=True)
class MemoryFacts(BackendFacts):
    """Which incarnation of the sandbox the record is about (persisted in edge.db):
    after a restart, the edge re-adopts it only if that very sandbox still exists."""

    boot: str

    @property
    def init_pid(self) -> int | None:
        return None  # no process: nothing for the edge to watch

    def to_json(self) -> dict[str, Any]:
        return {"boot": self.boot}


class MemoryBackend(Backend):
    kind = BackendKind.MEMORY
    # Files only: no agent (sessions), no pause, verify, pack, network or disk limits.
    capabilities = frozenset({Capability.FILES})

    def __init__(self, world: MemoryWorld = WORLD) -> None:
        self.world = world

    @classmethod
    def probe(cls) -> str | None:
        wanted = {k.strip() for k in os.environ.get(ENV, "").split(",")}
        if cls.kind.value in wanted:
            return None
        return f"a test backend: set {ENV}={cls.kind.value} to enable it"

    @classmethod
    def from_host(cls, host: BackendHost) -> Self:
        return cls()

    async def create(self, inp: CreateInput) -> BackendFacts:
        box = self.world.start(inp.id, {})
        return MemoryFacts(box.boot)

    def load_facts(self, data: Mapping[str, Any]) -> BackendFacts:
        return MemoryFacts(str(data.get("boot", "")))

    async def destroy(self, rec: SandboxRecord) -> None:
        self.world.kill(rec.id)

    def _box(self, rec: SandboxRecord) -> MemorySandbox:
        box = self.world.get(rec.id)
        if box is None or not isinstance(rec.facts, MemoryFacts) or box.boot != rec.facts.boot:
            raise BackendError(f"sandbox {rec.id} is gone", sandbox_id=rec.id)
        return box

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        box = self._box(rec)
        argv = commands.argv_of(req.command)
        box.ran.append(argv)
        started = time.monotonic()
        env = {**rec.spec.env, **req.env}
        out = commands.run(argv, box.files, env=env, workdir=req.workdir or rec.spec.workdir)
        stdout, truncated = out.stdout, len(out.stdout.encode()) > req.max_output_bytes
        if truncated:
            stdout = stdout.encode()[: req.max_output_bytes].decode(errors="ignore")
        return ExecResult(
            exit_code=out.exit_code,
            stdout=stdout,
            stderr=out.stderr,
            duration=time.monotonic() - started,
            truncated=truncated,
        )

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        data = self._box(rec).files.get(path)
        if data is None:
            raise FileNotFound(f"{path}: no such file", path=path, sandbox_id=rec.id)
        if len(data) > max_bytes:
            raise LimitExceeded(f"{path} is larger than {max_bytes} bytes", path=path)
        return data

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        self._box(rec).files[path] = bytes(data)

    async def is_alive(self, rec: SandboxRecord) -> bool:
        return await self.still_running(rec)

    async def still_running(self, rec: SandboxRecord) -> bool:
        try:
            self._box(rec)
        except BackendError:
            return False
        return True

    async def sweep(self, known_ids: set[str]) -> list[str]:
        gone = [sid for sid in self.world.ids() if sid not in known_ids]
        for sid in gone:
            self.world.kill(sid)
        return gone
