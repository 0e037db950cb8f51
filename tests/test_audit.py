"""The audit log and the events API: every command and file operation is recorded
outside the sandbox, tagged with job and trajectory, and queryable by job."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.api.events import AuditKind, EventKind, Severity
from dsec.errors import InvalidArgument
from dsec.security.audit import AuditLog
from tests.conftest import PlatformProcess


async def test_batched_rows_survive_reopen_and_filter(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db", flush_interval=0.01)
    log.start()
    log.tag("a-1", "job1", "t1")
    log.tag("b-2", "job2", None)
    log.record("a-1", AuditKind.COMMAND, "exec", command="ls")
    log.event("a-1", EventKind.PROTECTED_PATH, path="/grader/answer")
    log.event("b-2", EventKind.RESOURCE_LIMIT, limit="pids")
    await asyncio.sleep(0.05)  # the flusher writes the batch
    await log.close()

    again = AuditLog(tmp_path / "audit.db")
    rows = again.records(job_id="job1")
    assert [(r.kind, r.action) for r in rows] == [
        (AuditKind.COMMAND, "exec"),
        (AuditKind.EVENT, "protected_path"),
    ]
    assert all(r.trajectory_id == "t1" for r in rows)
    events = again.events(job_id="job1")
    assert len(events) == 1 and events[0].severity is Severity.CRITICAL
    assert events[0].detail == {"path": "/grader/answer"}
    assert [e.kind for e in again.events(kinds=[EventKind.RESOURCE_LIMIT])] == [
        EventKind.RESOURCE_LIMIT
    ]
    # seq continues after a restart, so cursors stay valid
    again.record("a-1", AuditKind.FILE, "read_file", path="/x")
    newer = again.records(since_seq=rows[-1].seq)
    assert [r.action for r in newer] == ["resource_limit", "read_file"]
    assert newer[-1].job_id == "job1"  # tags survive the restart too
    await again.close()


async def test_writers_on_many_threads_lose_nothing() -> None:
    log = AuditLog(None)

    def write(n: int) -> None:
        for i in range(500):
            log.record(f"s-{n}", AuditKind.NETWORK, "dns", name=f"h{i}")

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = log.records(limit=10_000)
    assert len(rows) == 4000
    assert [r.seq for r in rows] == sorted({r.seq for r in rows})
    await log.close()


def test_has_record_finds_a_process_end_batched_or_written(tmp_path: Path) -> None:
    """What a restarted edge asks before it takes an agent's word that an end was
    recorded: pending rows count, other processes and sandboxes do not."""
    audit = AuditLog(tmp_path / "audit.db")
    audit.record("s1", AuditKind.COMMAND, "process_end", process="p1", exit_code=0)
    assert audit.has_record("s1", AuditKind.COMMAND, "process_end", process="p1")
    assert not audit.has_record("s1", AuditKind.COMMAND, "process_end", process="p2")
    assert not audit.has_record("s2", AuditKind.COMMAND, "process_end", process="p1")
    assert not audit.has_record("s1", AuditKind.COMMAND, "process_start", process="p1")
    audit.flush()
    assert AuditLog(tmp_path / "audit.db").has_record(
        "s1", AuditKind.COMMAND, "process_end", process="p1"
    )


def test_huge_detail_is_clipped_not_refused() -> None:
    log = AuditLog(None)
    log.record("s-1", AuditKind.COMMAND, "exec", command="x" * 100_000)
    (row,) = log.records()
    assert "truncated" in row.detail and len(json.dumps(row.detail)) < 5000


@pytest.mark.root
async def test_commands_and_files_are_audited_by_job(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    job = "job-" + platform.edge_id
    spec = DSecContainerRunArgs(
        container_image=busybox_image, job_id=job, trajectory_id="traj-1", memory_limit_mb=64
    )
    async with await client.run_container(spec) as sb:
        await sb.run_shell("echo hi > /tmp/x")
        await sb.write_file("/tmp/y", b"data")
        await sb.read_file("/tmp/y")
        await sb.exec(["cat", "/tmp/x"])
        rows = await client.audit(job=job)
        assert {r.sandbox_id for r in rows} == {sb.id}
        assert all(r.trajectory_id == "traj-1" for r in rows)
        actions = [(r.kind.value, r.action) for r in rows]
        assert actions[0] == ("lifecycle", "create")
        assert ("command", "process_start") in actions or ("command", "exec") in actions
        commands = [r.detail.get("command") for r in rows if r.kind is AuditKind.COMMAND]
        assert "echo hi > /tmp/x" in commands and ["cat", "/tmp/x"] in commands
        files = {(r.action, r.detail.get("path")) for r in rows if r.kind is AuditKind.FILE}
        assert any(p == "/tmp/y" and "write" in a for a, p in files)
        assert any(p == "/tmp/y" and "read" in a for a, p in files)
        exit_rows = [r for r in rows if "exit_code" in r.detail]
        assert exit_rows and all(r.detail["exit_code"] == 0 for r in exit_rows)
        # A cursor returns only what is newer.
        last = rows[-1].seq
        await sb.run_shell("true")
        newer = await client.audit(job=job, since_seq=last)
        assert newer and all(r.seq > last for r in newer)
    final = await client.audit(job=job, kinds=[AuditKind.LIFECYCLE])
    assert [r.action for r in final] == ["create", "stopped"]
    assert await client.events(job=job) == []
    with pytest.raises(InvalidArgument):
        await client.events(job="x" * 200)


@pytest.mark.root
def test_cli_events_and_audit(platform: PlatformProcess) -> None:
    env = {"DSEC_URL": platform.url, "DSEC_API_KEY": platform.api_key, "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "dsec.cli.main"]
    res = subprocess.run(
        [*cli, "events", "--job", "nobody", "--json"], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []
    res = subprocess.run(
        [*cli, "events", "--kind", "nonsense"], env=env, capture_output=True, text=True
    )
    assert res.returncode == 2 and "nonsense" in res.stderr
    res = subprocess.run([*cli, "audit", "--limit", "5"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # Cursors: a page starts at '', a cluster's cursor is refused here, garbage too.
    res = subprocess.run([*cli, "audit", "--cursor", ""], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "next: --cursor '@" in res.stdout, res.stderr
    for bad, says in (("e1:5", "one node"), ("@x", "bad cursor")):
        res = subprocess.run(
            [*cli, "events", "--cursor", bad], env=env, capture_output=True, text=True
        )
        assert res.returncode != 0 and says in res.stdout + res.stderr, (bad, res)
        assert "Traceback" not in res.stderr


def test_tamper_watch_reports_each_change_once(tmp_path: Path) -> None:
    from dsec.security.tampering import TamperWatch

    upper = tmp_path / "upper"
    (upper / "usr/bin").mkdir(parents=True)
    (upper / "usr/local/bin").mkdir(parents=True)
    (upper / "usr/local/bin/tool").write_text("pip console script: not watched")
    watch = TamperWatch()
    assert watch.scan("s-1", upper).changes == []
    (upper / "usr/bin/python3").write_text("#!/bin/sh\necho 100% tests passed")
    os.mknod(upper / "usr/bin/pytest", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # whiteout
    first = watch.scan("s-1", upper)
    assert sorted(first.changes) == [
        ("/usr/bin/pytest", "deleted"),
        ("/usr/bin/python3", "written"),
    ]
    assert first.incomplete == []
    assert watch.scan("s-1", upper).changes == []  # reported once
    watch.forget("s-1")
    assert len(watch.scan("s-1", upper).changes) == 2


@pytest.mark.root  # trusted.* xattrs (the opaque mark) need CAP_SYS_ADMIN
def test_tamper_watch_sees_what_hijacks_later_commands(tmp_path: Path) -> None:
    """Loader config, shell start-up, interpreter hooks, /usr/local/bin shadows, an
    opaque (replaced) directory and a rename: each is a change."""
    from dsec.security.tampering import TamperWatch

    upper = tmp_path / "upper"
    (upper / "usr/local/bin").mkdir(parents=True)
    (upper / "usr/lib/python3.11").mkdir(parents=True)
    watch = TamperWatch()
    assert watch.scan("s-1", upper).changes == []
    (upper / "etc/ld.so.conf.d").mkdir(parents=True)
    for rel in ("etc/ld.so.preload", "etc/ld.so.conf.d/evil.conf", "etc/profile", "etc/hosts"):
        (upper / rel).write_text("x")
    site = upper / "usr/local/lib/python3.11/dist-packages"
    site.mkdir(parents=True)
    (site / "evil.pth").write_text("import os")
    (site / "numpy").mkdir()  # an honest package: not a start-up hook
    (upper / "usr/lib/python3.11/sitecustomize.py").write_text("x")
    (upper / "usr/local/bin/python3").write_text("#!/bin/sh")  # shadows /usr/bin/python3
    (upper / "usr/local/bin/mytool").write_text("#!/bin/sh")  # shadows nothing
    found = dict((p, c) for p, c in watch.scan("s-1", upper).changes)
    assert found == {
        "/etc/ld.so.preload": "written",
        "/etc/ld.so.conf.d/evil.conf": "written",
        "/etc/profile": "written",
        "/usr/local/lib/python3.11/dist-packages/evil.pth": "written",
        "/usr/lib/python3.11/sitecustomize.py": "written",
        "/usr/local/bin/python3": "shadowed",
    }
    # A renamed file is a new entry; an opaque directory hides everything below it.
    os.rename(upper / "usr/lib/python3.11/sitecustomize.py", upper / "usr/lib/python3.11/x.py")
    opaque = upper / "usr/lib/python3.11"
    os.setxattr(opaque, "trusted.overlay.opaque", b"y")
    assert set(watch.scan("s-1", upper).changes) == {
        ("/usr/lib/python3.11/x.py", "written"),
        ("/usr/lib/python3.11", "replaced"),
    }


@pytest.mark.root
async def test_overwriting_a_system_binary_raises_an_event(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    job = "tamper-" + platform.edge_id
    spec = DSecContainerRunArgs(container_image=busybox_image, job_id=job, memory_limit_mb=64)
    async with await client.run_container(spec) as sb:
        await sb.run_shell("echo ok > /tmp/fine")  # ordinary work raises nothing
        assert await client.events(job=job) == []
        await sb.run_shell("printf '#!/bin/sh\\necho PASSED\\n' > /bin/true.new && rm /bin/ls")
        (event,) = await client.events(job=job)
        assert event.kind is EventKind.BINARY_TAMPERING and event.sandbox_id == sb.id
        assert set(event.detail["changes"]) == {"written /bin/true.new", "deleted /bin/ls"}
