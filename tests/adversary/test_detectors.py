"""Adversarial suite, detectors: root inside a sandbox tries to blind or crash them.

Each attempt is written the way a determined agent would: exhaust the scan's budget
then tamper, bury a change under a tree too deep to walk, name a file so that it
breaks whoever reports it, change binaries from the background after the last scan,
grow the detector's memory without bound, point the walker at the host, crash a
detector outright. Each must end with an event that names it (the tampering, or a
``scan_incomplete`` / ``detector_error`` saying what was not looked at) and with the
audit stream still going: a later command is still recorded.

The first four run for real in a sandbox; the memory bound, the planted link and the
injected exception are unit tests on a fake upper dir and a real ``Edge``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.api.events import AuditKind, EventKind, SecurityEvent
from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind
from dsec.backends.base import Backend, BackendFacts, BackendHost, CreateInput, SandboxRecord
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.state import EdgeStateDB
from dsec.errors import DSecError
from dsec.sdk.client import Sandbox
from dsec.security import tampering
from dsec.security.audit import AuditLog
from dsec.security.tampering import TamperWatch
from tests.conftest import PlatformProcess

# ---- against a real sandbox -------------------------------------------------------------


@dataclass
class Box:
    client: DSecClient
    sandbox: Sandbox
    job: str

    async def sh(self, command: str, *, timeout: float = 120) -> str:
        res = await self.sandbox.run_shell(command, timeout=timeout)
        assert res.exit_code == 0, res.stdout + res.stderr
        return res.stdout

    async def events(self, kind: EventKind) -> list[SecurityEvent]:
        return list(await self.client.events(job=self.job, kinds=[kind], limit=10_000))

    async def wait_events(
        self, kind: EventKind, match: Callable[[SecurityEvent], bool] = lambda e: True
    ) -> list[SecurityEvent]:
        """The events of ``kind`` once one matches (a command's hook may still be
        running when its reply arrives: polled, at most 200 times)."""
        for _ in range(200):
            found = await self.events(kind)
            if any(match(e) for e in found):
                return found
            await asyncio.sleep(0.05)
        raise AssertionError(f"no matching {kind.value} event for job {self.job}")

    async def changes(self, wanted: str) -> list[str]:
        """Every reported change, once ``wanted`` is among them."""
        found = await self.wait_events(
            EventKind.BINARY_TAMPERING, lambda e: wanted in e.detail["changes"]
        )
        return [str(c) for ev in found for c in ev.detail["changes"]]

    async def still_recorded(self) -> None:
        """The audit stream goes on: a command after the attack is on record."""
        marker = "after-" + secrets.token_hex(4)
        await self.sh(f"echo {marker}")
        rows = await self.client.audit(job=self.job, kinds=[AuditKind.COMMAND], limit=10_000)
        assert any(marker in str(r.detail.get("command")) for r in rows), marker


@pytest.fixture
async def box(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> AsyncIterator[Box]:
    job = "adv-det-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(
        container_image=busybox_image, memory_limit_mb=128, disk_limit_mb=256, job_id=job
    )
    sandbox = await client.run_container(spec)
    try:
        yield Box(client, sandbox, job)
    finally:
        with contextlib.suppress(DSecError):
            await sandbox.stop()


@pytest.mark.root
async def test_budget_exhaustion_cannot_hide_a_tamper(box: Box) -> None:
    """30,000 junk entries in /usr/lib (six times a pass's budget), then a planted
    python3 in the same command: the python3 change is reported on that command, and
    the pass says it could not look at everything."""
    await box.sh(
        "mkdir -p /usr/lib/junk && cd /usr/lib/junk && seq 1 30000 | xargs touch"
        " && printf '#!/bin/sh\\necho PASSED\\n' > /bin/python3 && chmod +x /bin/python3"
    )
    assert "written /bin/python3" in await box.changes("written /bin/python3")
    (first, *_) = await box.wait_events(EventKind.SCAN_INCOMPLETE)
    assert first.severity.value == "critical"
    assert first.detail["reason"] == "budget" and first.detail["stopped_at"].startswith(
        "/usr/lib/junk"
    )
    await box.still_recorded()


@pytest.mark.root
async def test_a_tree_too_deep_to_walk_is_reported_not_fatal(box: Box) -> None:
    """2,000 nested directories (the old recursive scan raised RecursionError in the
    after-command hook, and from then on every detector was silent)."""
    try:
        await box.sh(
            "mkdir -p /usr/lib && cd /usr/lib && i=0 && while [ $i -lt 2000 ];"
            " do mkdir d && cd d; i=$((i+1)); done && echo x > hidden.so"
        )
        await box.wait_events(EventKind.SCAN_INCOMPLETE, lambda e: e.detail["reason"] == "too_deep")
        # Still watching: a tamper after the deep tree is reported.
        await box.sh("echo evil > /bin/after-deep")
        assert "written /bin/after-deep" in await box.changes("written /bin/after-deep")
        assert await box.events(EventKind.DETECTOR_ERROR) == []
        await box.still_recorded()
    finally:  # the host removes a sandbox's tree recursively: leave it shallow
        with contextlib.suppress(DSecError):
            await box.sandbox.run_shell("rm -rf /usr/lib/d", timeout=120)


@pytest.mark.root
async def test_a_hostile_file_name_is_reported_intact_and_harmless(box: Box) -> None:
    """Newline, ESC sequences, an OSC 8 link, bidi override and a byte that is not
    UTF-8 in one name: the event carries it (escaped where it is not UTF-8) and the
    events API, which must encode it as JSON, does not break."""
    name = r"evil\nforged \033[31mred\033]8;;https:x\007\342\200\256\377"  # printf escapes
    await box.sh(f"touch \"/bin/$(printf '{name}')\"")
    found = await box.wait_events(
        EventKind.BINARY_TAMPERING,
        lambda e: any(str(c).startswith("written /bin/evil") for c in e.detail["changes"]),
    )
    (hit,) = [str(c) for e in found for c in e.detail["changes"] if "/bin/evil" in str(c)]
    assert "\n" in hit and "\x1b[31m" in hit and "\\xff" in hit and "\u202e" in hit
    await box.still_recorded()


@pytest.mark.root
async def test_a_background_change_after_the_last_scan_is_caught_next_time(box: Box) -> None:
    """A background process waits for the last command to end (its scan is done),
    then replaces a binary: the next ``command_finished`` (the next command; a verify
    calls it too, before it freezes the agent) reports it."""
    proc = await box.sandbox.start(
        "while [ ! -e /tmp/go ]; do sleep 0.05; done; sleep 0.3;"
        " echo evil > /bin/late && touch /tmp/done; sleep 60"
    )
    try:
        await box.sh("touch /tmp/go")  # the "last command": scanned before the write
        for _ in range(200):  # file reads do not scan: wait for the write itself
            with contextlib.suppress(DSecError):
                await box.sandbox.read_file("/tmp/done")
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the background writer did not run")
        await box.sh("true")  # command_finished runs again
        assert "written /bin/late" in await box.changes("written /bin/late")
    finally:
        with contextlib.suppress(DSecError):
            await proc.kill()
    await box.still_recorded()


# ---- unit tests on a fake upper dir -------------------------------------------------------


def test_memory_stays_bounded_however_many_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent creating millions of files and directories must not grow the edge's
    memory: the tracked directories and remembered paths stay under their caps (made
    small here, the tree moderate), the overflow is reported, and a tamper elsewhere
    is still seen."""
    monkeypatch.setattr(tampering, "MAX_NODES", 40)
    monkeypatch.setattr(tampering, "MAX_RECENT", 100)
    upper = tmp_path / "upper"
    (upper / "bin").mkdir(parents=True)
    junk = upper / "usr/lib/junk"
    for d in range(200):
        (junk / f"d{d}").mkdir(parents=True)
        for f in range(20):
            (junk / f"d{d}" / f"f{f}").touch()
    watch = TamperWatch()
    reasons: set[str] = set()
    for _ in range(10):
        result = watch.scan("s-1", upper)
        reasons.update(i.reason for i in result.incomplete)
        nodes, recent = watch.tracked("s-1")
        assert nodes <= 40 and recent <= 100
    assert "too_many_directories" in reasons
    (upper / "bin/sh").write_text("evil")
    later = watch.scan("s-1", upper)
    assert ("/bin/sh", "written") in later.changes
    assert any(i.reason == "too_many_directories" for i in later.incomplete)  # still says so


def test_a_planted_link_never_leads_the_walk_out_of_the_upper_dir(tmp_path: Path) -> None:
    """/usr/lib/evil -> / (and /usr/bin itself a link): reported as written, never
    followed, so the host's tree can neither exhaust the budget nor be listed."""
    upper = tmp_path / "upper"
    (upper / "usr/lib").mkdir(parents=True)
    (upper / "usr/lib/evil").symlink_to("/")
    (upper / "usr/bin").symlink_to("/usr/bin")
    watch = TamperWatch()
    result = watch.scan("s-1", upper)
    assert set(result.changes) == {("/usr/lib/evil", "written"), ("/usr/bin", "written")}
    assert result.incomplete == []
    assert watch.tracked("s-1")[0] <= 3  # root, usr, usr/lib


class _StubBackend(Backend):
    """Just enough backend for the edge's exec path: commands succeed at once."""

    kind = BackendKind.CONTAINER

    def __init__(self, upper: Path) -> None:
        self.upper = upper

    @classmethod
    def from_host(cls, host: BackendHost) -> _StubBackend:
        raise NotImplementedError

    async def create(self, inp: CreateInput) -> BackendFacts:
        raise NotImplementedError

    async def destroy(self, rec: SandboxRecord) -> None:
        return None

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        return ExecResult(exit_code=0, stdout="", stderr="", duration=0.0, truncated=True)

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        raise NotImplementedError

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        raise NotImplementedError

    async def is_alive(self, rec: SandboxRecord) -> bool:
        return True

    async def still_running(self, rec: SandboxRecord) -> bool:
        return True

    async def adopt(self, rec: SandboxRecord) -> None:
        return None

    async def sweep(self, live: set[str]) -> list[str]:
        return []

    def writable_dir(self, rec: SandboxRecord) -> Path | None:
        return self.upper


@pytest.fixture
def stub_edge(tmp_path: Path) -> Iterator[tuple[Edge, str]]:
    upper = tmp_path / "upper"
    (upper / "bin").mkdir(parents=True)
    state = EdgeStateDB(tmp_path / "edge.db")
    edge = Edge(
        edge_id="e1",
        backends=[_StubBackend(upper)],
        images=None,  # type: ignore[arg-type]
        state=state,
        admission=Admission(max_sandboxes=4, memory_overcommit=1.0),
        audit=AuditLog(None),
    )
    now = datetime.now(UTC)
    rec = SandboxRecord(
        id="e1-0123456789abcdef",
        spec=DSecContainerRunArgs(container_image="busybox", job_id="job-hook"),
        image=ImageInfo(
            name="busybox", tag="latest", digest="sha256:0", layers=[], size_bytes=0, created_at=now
        ),
        state=SandboxState.RUNNING,
        created_at=now,
        updated_at=now,
        edge="e1",
    )
    edge._records[rec.id] = rec
    edge.limits.track(rec.id)
    try:
        yield edge, rec.id
    finally:
        state.close()


async def test_a_detector_that_raises_never_stops_the_audit_stream(
    stub_edge: tuple[Edge, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Both after-command detectors crash on every command (as a RecursionError did):
    each command is still recorded, output-limit events still come, every failure is a
    detector_error event, and the log says so once per detector and sandbox."""
    edge, sid = stub_edge

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded (\x1b[2J forged)")

    monkeypatch.setattr(edge.tamper, "scan", boom)
    monkeypatch.setattr(edge.limits, "_check", boom)
    caplog.set_level(logging.ERROR, logger="dsec.security.guard")
    for i in range(3):
        await edge.exec(sid, ExecRequest(command=["echo", str(i)]))
    edge.command_finished(sid)  # as a verify calls it: never raises either
    audit = edge.audit
    commands = [r.detail["command"] for r in audit.records(kinds=[AuditKind.COMMAND])]
    assert commands == [["echo", "0"], ["echo", "1"], ["echo", "2"]]
    errors = audit.events(kinds=[EventKind.DETECTOR_ERROR])
    assert {e.detail["detector"] for e in errors} == {"tamper", "limits"}
    assert sum(e.detail["detector"] == "tamper" for e in errors) == 4
    assert all(e.severity.value == "critical" for e in errors if e.detail["detector"] == "tamper")
    # The output limit (the stub truncates) is still reported on every command.
    limits = audit.events(kinds=[EventKind.RESOURCE_LIMIT])
    assert [e.detail["limit"] for e in limits] == ["output"] * 3
    logged = [r for r in caplog.records if "failed for sandbox" in r.getMessage()]
    assert len(logged) == 2  # once per detector and sandbox, not per command
    # Once the detector works again, tampering is reported again.
    monkeypatch.undo()
    rec = edge.record(sid)
    upper = edge.backend_of(rec).writable_dir(rec)
    assert upper is not None
    (upper / "bin/python3").write_text("x")
    edge.command_finished(sid)
    (ev,) = audit.events(kinds=[EventKind.BINARY_TAMPERING])
    assert ev.detail["changes"] == ["written /bin/python3"]
    await audit.close()


def test_scan_is_iterative_even_below_the_recursion_limit(tmp_path: Path) -> None:
    """A tree deeper than Python's recursion limit under a fake upper dir: the scan
    returns (no RecursionError), says it is too deep, and still sees /bin."""
    upper = tmp_path / "upper"
    (upper / "bin").mkdir(parents=True)
    (upper / "usr/lib").mkdir(parents=True)
    with _deep_tree(upper / "usr/lib", 1500):
        (upper / "bin/true").write_text("evil")
        watch = TamperWatch()
        result = watch.scan("s-1", upper)
        assert ("/bin/true", "written") in result.changes
        assert any(i.reason == "too_deep" for i in result.incomplete)


@contextlib.contextmanager
def _deep_tree(base: Path, depth: int) -> Iterator[None]:
    """``base/d/d/.../d``, made and removed without recursion (shutil.rmtree recurses)."""
    fds = [os.open(base, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fds[-1])
            fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1])
            os.close(fds[-1])
            fds[-1] = fd
        os.close(fds.pop())
        yield
    finally:
        for fd in fds:
            os.close(fd)
        d, below, spare = base / "d", base / "d" / "d", base / "spare"
        while d.exists():  # peel one level at a time: O(1) each, no recursion
            if below.exists():
                below.rename(spare)
                d.rmdir()
                spare.rename(d)
            else:
                d.rmdir()
