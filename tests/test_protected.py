"""Protected paths on a real platform: grader/answer content only a verifier step sees.

The agent runs as root with every trick a hostile rollout would try (/proc/<pid>/root,
/proc/1/fd, a search of the whole file system, the file API, sessions); the answer is
simply not in its sandbox. ``verify`` sees it together with the agent's current files,
while the agent is frozen, and leaves nothing behind. Nothing here is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from dsec import DSecClient, DSecContainerRunArgs, linux
from dsec.api.events import EventKind
from dsec.api.protected import ProtectedMount
from dsec.backends.container.oci_spec import MASK_DIR_NAME, masked_paths
from dsec.resources import cgroups
from dsec.security import protected as protected_paths
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

SECRET = "ANSWER-7f3c91e2"
GRADE = """#!/bin/sh
# the grader: runs the agent's solution and compares with the hidden answer
out=$($DSEC_UNTRUSTED sh /work/solution.sh) || exit 2
[ "$out" = "$(cat /grader/expected.txt)" ] && echo PASS && exit 0
echo "FAIL: got $out"; exit 1
"""


def spec(image: str, **kw: object) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 128)
    kw.setdefault("job_id", "job-protected")
    kw.setdefault(
        "protected",
        [{"path": "/grader", "files": {"expected.txt": SECRET, "grade.sh": GRADE}}],
    )
    return DSecContainerRunArgs.model_validate({"container_image": image, **kw})


def sandbox_cgroup(platform: PlatformProcess, sandbox_id: str) -> str:
    return f"/dsec/{platform.edge_id}/{sandbox_id}"


def verifier_leftovers(platform: PlatformProcess, sandbox_id: str) -> list[str]:
    """What a finished verifier left (its cleanup runs just after the answer: wait)."""
    deadline = time.monotonic() + 5
    while (found := _verifier_leftovers(platform, sandbox_id)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def _verifier_leftovers(platform: PlatformProcess, sandbox_id: str) -> list[str]:
    vid = sandbox_id + ".v"
    host = cgroups.detect()
    found = []
    if (platform.data_dir / "sandboxes" / vid).exists():
        found.append("dir")
    if (platform.data_dir / "run" / "crun" / vid).exists():
        found.append("crun state")
    if vid in host.children(f"/dsec/{platform.edge_id}"):
        found.append("cgroup")
    found += [m.mount_point for m in linux.mounts(platform.data_dir) if m.fstype == "overlay"]
    return found


async def wait_events(client: DSecClient, sandbox_id: str, n: int = 1) -> list[object]:
    deadline = time.monotonic() + 5
    while True:
        events = await client.events(sandbox=sandbox_id, kinds=[EventKind.PROTECTED_PATH])
        if len(events) >= n or time.monotonic() > deadline:
            return list(events)
        await asyncio.sleep(0.05)


def files_containing(top: Path, needle: bytes, skip: Path) -> list[Path]:
    found = []
    for dirpath, dirs, files in os.walk(top):
        if Path(dirpath) == skip:
            dirs.clear()
            continue
        for name in files:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
                # Regular files up to 64 MiB: the database, its WAL, logs, tokens (not
                # the sparse disk image that holds the sandboxes' directories).
                if (
                    stat.S_ISREG(st.st_mode)
                    and st.st_size < 64 << 20
                    and needle in path.read_bytes()
                ):
                    found.append(path)
            except OSError:
                continue
    return found


async def test_answer_readable_by_verify_only(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    sb = await client.run_container(spec(busybox_image))
    try:
        # Inline contents are never stored by the platform nor echoed back: names only.
        assert sb.info.spec.protected[0].files == {"expected.txt": "", "grade.sh": ""}
        assert (await client.get(sb.id)).info.spec.protected[0].files["expected.txt"] == ""
        stored = await asyncio.to_thread(
            files_containing, platform.data_dir, SECRET.encode(), platform.data_dir / "sandboxes"
        )
        assert stored == [], "the answer reached platform state or logs"
        assert SECRET.encode() not in await asyncio.to_thread(platform.log_path.read_bytes)
        # The agent, root, tries everything it can think of.
        attempts = [
            "cat /grader/expected.txt",
            "cat /proc/1/root/grader/expected.txt",
            "cat /proc/self/root/grader/expected.txt",
            "for p in /proc/[0-9]*; do cat $p/root/grader/expected.txt; done",
            "ls -la /proc/1/fd/ /proc/1/root/",
            "cat /proc/1/fd/3",
            "find / -xdev -type f 2>/dev/null | xargs grep -l " + SECRET + " 2>/dev/null",
            "grep -rl " + SECRET + " /dev/shm /grader /tmp 2>/dev/null",
            "cat /proc/1/environ /proc/1/cmdline",
        ]
        for cmd in attempts:
            r = await sb.run_shell(cmd, timeout=30)
            assert SECRET not in r.stdout + r.stderr, cmd
        assert await sb.read_file("/grader/expected.txt") == b""
        sess = await sb.session()
        r = await sess.run("cd /grader && cat * ; ls")
        assert SECRET not in r.stdout and "grade.sh" in r.stdout  # the decoy has the names
        # Read-only: the agent cannot plant its own "expected" output either.
        r = await sb.run_shell("echo forged > /grader/expected.txt")
        assert r.exit_code != 0

        v = await sb.verify("cat /grader/expected.txt")
        assert (v.exit_code, v.stdout) == (0, SECRET)

        events = await wait_events(client, sb.id)
        assert events, "opening the decoy raised no protected_path event"
        seen = {(e.detail["path"], e.severity.value) for e in events}  # type: ignore[attr-defined]
        assert ("/grader/expected.txt", "critical") in seen  # a file: critical
        assert ("/grader", "warning") in seen  # a listing (cd /grader; ls): a warning
        assert all(e.job_id == "job-protected" for e in events)  # type: ignore[attr-defined]
        audit = await client.audit(sandbox=sb.id, kinds=["command"])
        assert any(a.action == "verify" and a.detail.get("exit_code") == 0 for a in audit)
    finally:
        await sb.stop()


async def test_verifier_grades_the_agents_current_files(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    sb = await client.run_container(spec(busybox_image))
    try:
        await sb.run_shell("mkdir -p /work && echo 'echo wrong' > /work/solution.sh")
        v = await sb.verify("sh /grader/grade.sh", mode="isolated")
        assert (v.exit_code, v.stdout, v.passed) == (1, "FAIL: got wrong\n", False)
        # The agent fixes its solution (through the file API this time); verify sees it.
        await sb.write_file("/work/solution.sh", f"echo {SECRET}\n".encode())
        v = await sb.verify(["sh", "/grader/grade.sh"], mode="isolated")
        assert (v.exit_code, v.stdout, v.passed) == (0, "PASS\n", True)
        assert "/work" in v.graded
        # A deleted file is gone for the verifier too (whiteouts of the agent's upper).
        await sb.run_shell("rm /work/solution.sh")
        assert (await sb.verify("test -e /work/solution.sh", mode="isolated")).exit_code == 1
        # The verifier's own writes never reach the agent.
        assert (await sb.verify("echo x > /tmp/from-verifier", mode="isolated")).exit_code == 0
        assert (await sb.run_shell("test -e /tmp/from-verifier")).exit_code == 1
        # A separate pid namespace and a fresh root: the agent's processes are not there.
        proc = await sb.start("sleep 300")
        v = await sb.verify("ps -o comm | grep -c sleep", mode="isolated")
        assert v.stdout.strip() == "0"
        await proc.kill()
        assert verifier_leftovers(platform, sb.id) == []
    finally:
        await sb.stop()


async def test_agent_frozen_during_verify_and_thawed_after(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    sb = await client.run_container(spec(busybox_image))
    host = cgroups.detect()
    rel = sandbox_cgroup(platform, sb.id)
    try:
        await sb.start("while :; do cut -d' ' -f1 /proc/uptime >> /tmp/ticks; usleep 20000; done")
        await asyncio.sleep(0.2)
        task = asyncio.create_task(
            sb.verify("sleep 1; wc -l < /tmp/ticks", graded=["/tmp"], mode="isolated")
        )
        seen_frozen = False
        while not task.done():
            seen_frozen |= protected_paths.is_frozen(host, rel)
            await asyncio.sleep(0.02)
        v = await task
        assert seen_frozen, "the agent's cgroup was never frozen during verify"
        assert not protected_paths.is_frozen(host, rel)
        # Frozen means the ticker did not run while the verifier slept a second.
        ticks = [float(x) for x in (await sb.read_file("/tmp/ticks")).split()]
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert max(gaps) >= 0.9, "no gap of ~1 s: the agent kept running"
        assert int(v.stdout) <= len(ticks)

        # Failing and timed-out verifier commands thaw the agent as well.
        v = await sb.verify("exit 3", mode="isolated")
        assert v.exit_code == 3 and not protected_paths.is_frozen(host, rel)
        v = await sb.verify("sleep 30", timeout=0.5, mode="isolated")
        assert v.timed_out and not protected_paths.is_frozen(host, rel)
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"
        assert verifier_leftovers(platform, sb.id) == []
    finally:
        await sb.stop()


async def test_layer_backed_protected_path(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    src = tmp_path / "suite"
    (src / "tests").mkdir(parents=True)
    (src / "tests" / "answer.txt").write_text(SECRET)
    layer = await client.build_layer("grader-suite:v1", "dir", str(src), prefix="/")
    sb = await client.run_container(
        spec(busybox_image, protected=[{"path": "/opt/grader", "layer": layer.ref}])
    )
    try:
        r = await sb.run_shell("find /opt/grader; cat /opt/grader/tests/answer.txt")
        assert "/opt/grader/tests/answer.txt" in r.stdout and SECRET not in r.stdout
        v = await sb.verify("cat /opt/grader/tests/answer.txt")
        assert v.stdout == SECRET
        events = await wait_events(client, sb.id)
        assert any(e.detail["path"] == "/opt/grader/tests/answer.txt" for e in events)  # type: ignore[attr-defined]
    finally:
        await sb.stop()


async def test_no_platform_file_or_host_socket_inside(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    sb = await client.run_container(spec(busybox_image))
    try:
        mountinfo = (await sb.read_file("/proc/self/mountinfo")).decode()
        data_dir = str(platform.data_dir)
        for line in mountinfo.splitlines():
            left, _, right = line.partition(" - ")
            fields = left.split()
            root, point, fstype = fields[3], fields[4], right.split()[0]
            if fstype in ("proc", "tmpfs", "devpts", "mqueue", "sysfs", "cgroup", "overlay"):
                continue
            if fstype == "devtmpfs" and root == "/null":
                continue  # masked kernel paths (/proc/kcore, ...) are /dev/null binds
            if root.endswith(f"/{MASK_DIR_NAME}") and point in masked_paths():
                continue  # masked directories: one shared empty read-only directory
            if (
                fstype == "nsfs"
                and point.startswith("/sys/fs/cgroup/")
                and point.endswith("/.netns")
            ):
                continue  # the shared /sys's blank netns, pinned below a covered directory
            # Bind mounts: the agent binary, and the decoy (names only, no content).
            assert point in ("/.dsec/init", "/grader"), line
            if point == "/grader":
                assert root.endswith("/decoy/0"), line
        # Nothing of the data dir (logs, audit db, tokens, edge state) under any name.
        r = await sb.run_shell(f"ls {data_dir} 2>&1; find / -name 'edge*.db' -o -name '*.key'")
        assert "No such file" in r.stdout and ".db" not in r.stdout
        # No unix socket file anywhere in the sandbox (agent socket, spawner socket, ...).
        r = await sb.run_shell("find / -path /proc -prune -o -type s -print 2>/dev/null")
        assert r.stdout == ""
        # The agent's listening socket, fd 3 of pid 1, is out of reach of a child.
        r = await sb.run_shell(
            "ls -l /proc/1/fd/3 2>&1; readlink /proc/1/root 2>&1; cat /proc/1/fd/3 2>&1; true"
        )
        assert "socket:" not in r.stdout and "Permission denied" in r.stdout
    finally:
        await sb.stop()


async def test_verify_needs_a_running_sandbox_and_valid_input(
    client: DSecClient, busybox_image: str
) -> None:
    from dsec.errors import InvalidArgument, SandboxNotRunning

    with pytest.raises(ValidationError):
        ProtectedMount(path="/proc/x", files={"a": "b"})
    with pytest.raises(ValidationError):
        ProtectedMount(path="/g", files={"../etc/passwd": "b"})
    with pytest.raises(ValidationError):
        ProtectedMount(path="/g")  # neither layer nor files
    with pytest.raises(ValidationError):
        spec(busybox_image, protected=[{"path": "/g", "files": {"a": "1"}}] * 2)
    sb = await client.run_container(spec(busybox_image, protected=[]))
    # Without protected paths verify still works: the grader sees the agent's files.
    await sb.run_shell("echo hi > /root/x")
    assert (await sb.verify("cat /root/x")).stdout == "hi\n"
    await sb.stop()
    with pytest.raises(SandboxNotRunning):
        await sb.verify("true")
    with pytest.raises(InvalidArgument):
        await sb.verify("")


def test_verify_cli(platform: PlatformProcess, busybox_image: str, tmp_path: Path) -> None:
    from dsec import DSecSyncClient

    (tmp_path / "answer.txt").write_text(SECRET)
    env = dict(os.environ, DSEC_URL=platform.url, DSEC_API_KEY=platform.api_key)

    def dsec(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [".venv/bin/dsec", *argv], capture_output=True, text=True, env=env, check=False
        )

    with DSecSyncClient(platform.url, platform.api_key) as c:
        c.build_layer("grader-cli:v1", "dir", str(tmp_path), prefix="/")
        res = dsec("sandbox", "create", "--image", busybox_image, "--protect", "/g=grader-cli:v1")
        assert res.returncode == 0, res.stderr
        sandbox_id = res.stdout.strip()
        try:
            res = dsec("sandbox", "exec", sandbox_id, "cat", "/g/answer.txt")
            assert SECRET not in res.stdout
            res = dsec("sandbox", "verify", "--isolated", sandbox_id, "cat", "/g/answer.txt")
            assert (res.returncode, res.stdout) == (0, SECRET), res.stderr
            res = dsec("sandbox", "verify", "--isolated", "--shell", sandbox_id, "exit", "5")
            assert res.returncode == 5
            v = c.get(sandbox_id).verify("exit 4", mode="isolated")  # the sync twin
            assert (v.exit_code, v.passed) == (4, False)
            res = dsec("sandbox", "verify", sandbox_id, "true")  # fresh: the sandbox ends
            assert res.returncode == 0, res.stderr
            assert c.get(sandbox_id).info.state.value == "stopped"
        finally:
            dsec("sandbox", "rm", sandbox_id)
        res = dsec("sandbox", "create", "--image", busybox_image, "--protect", "/proc/x=a:1")
        assert res.returncode != 0 and "reserved" in res.stdout + res.stderr


async def test_parent_swapped_for_a_symlink_stays_inside(
    client: DSecClient, busybox_image: str
) -> None:
    """The agent moves the protected path's parent away and leaves a symlink to a
    host-looking path: the verifier's bind mount still resolves inside its own root."""
    sb = await client.run_container(
        spec(busybox_image, protected=[{"path": "/opt/grader", "files": {"a.txt": SECRET}}])
    )
    try:
        r = await sb.run_shell("mv /opt /opt2 && ln -s ../../../../etc /opt && ls -la /")
        assert r.exit_code == 0, r.stderr
        v = await sb.verify("cat /opt/grader/a.txt; touch /opt/grader/x 2>/dev/null; true")
        assert not await asyncio.to_thread(Path("/etc/grader").exists)
        assert v.exit_code == 0
    finally:
        await sb.stop()


def test_edge_killed_mid_verify_thaws_the_agent_after_restart() -> None:
    # Sync on purpose: the platform's leak check must run outside an event loop.
    from tests.conftest import platform_process

    host = cgroups.detect()

    async def crash_mid_verify(plat: PlatformProcess) -> str:
        async with DSecClient(plat.url, plat.api_key) as c:
            await c.build_image("busybox")
            sb = await c.run_container(spec("busybox:latest"))
            task = asyncio.create_task(sb.verify("sleep 30", mode="isolated"))
            rel = sandbox_cgroup(plat, sb.id)
            for _ in range(500):
                if protected_paths.is_frozen(host, rel):
                    break
                await asyncio.sleep(0.02)
            assert protected_paths.is_frozen(host, rel)
            plat.kill()
            with contextlib.suppress(Exception):
                await task
            return sb.id

    async def after_restart(plat: PlatformProcess, sandbox_id: str) -> None:
        async with DSecClient(plat.url, plat.api_key) as c:
            again = await c.get(sandbox_id)
            assert again.info.state.value == "running", again.info.reason
            assert not protected_paths.is_frozen(host, sandbox_cgroup(plat, sandbox_id))
            assert (await again.run_shell("echo ok")).stdout == "ok\n"
            assert verifier_leftovers(plat, sandbox_id) == []
            assert (await again.verify("cat /grader/expected.txt")).stdout == SECRET
            await again.stop()

    with platform_process() as plat:
        sandbox_id = asyncio.run(crash_mid_verify(plat))
        plat.start()
        asyncio.run(after_restart(plat, sandbox_id))
