"""Forging a verdict: a hostile agent (root inside) against the verify step.

Every attack leaves a *wrong* answer and tries to make the grader say PASS anyway: by
changing the world the grader runs in (its shell, its tools, its PATH, its interpreter's
start-up files, the runner the platform gives it), by pointing graded files at the
answers, by having its own code read the answers or forge the result when the grader
runs it, or by acting behind the grader's back (background processes, shared state).
Each asserts the verdict stays FAIL (``passed`` is False) and, where the attempt is
visible to a detector, that an event names it. Real platform, real sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, ProtectedMount, VerifyResult
from dsec.api.events import EventKind
from dsec.api.verify import VerifyMode
from dsec.errors import DSecError, InvalidArgument, SandboxNotRunning
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

# The grader of a data task: the agent's answer file must equal the hidden one.
GRADE_DATA = """#!/bin/sh
[ -f /work/answer.txt ] || { echo "FAIL: no answer"; exit 1; }
[ "$(cat /work/answer.txt)" = "$(cat /grader/expected.txt)" ] && { echo PASS; exit 0; }
echo FAIL; exit 1
"""
# The grader of a code task: run the agent's program, compare with the hidden output.
GRADE_CODE = """#!/bin/sh
out=$($DSEC_UNTRUSTED sh /work/solution.sh 2>/dev/null)
[ "$out" = "$(cat /grader/expected.txt)" ] && { echo PASS; exit 0; }
echo "FAIL: got $out"; exit 1
"""
FORGE_PASS = "#!/bin/busybox sh\necho PASS\nexit 0\n"


@dataclass
class Task:
    client: DSecClient
    sb: Sandbox
    answer: str
    job: str

    async def sh(self, command: str) -> str:
        res = await self.sb.run_shell(command, timeout=60)
        return res.stdout + res.stderr

    async def verify(self, grader: str, mode: VerifyMode = "fresh", **kw: object) -> VerifyResult:
        return await self.sb.verify(grader, mode=mode, timeout=60, **kw)  # type: ignore[arg-type]

    async def event(self, kind: EventKind, needle: str = "") -> None:
        for _ in range(60):
            for ev in await self.client.events(job=self.job, kinds=[kind]):
                if needle in str(ev.detail):
                    return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {kind.value} event mentioning {needle!r} for job {self.job}")


def assert_fail(v: VerifyResult, why: str) -> None:
    assert not v.passed, f"{why}: forged a PASS ({v.stdout!r} {v.stderr!r})"
    assert v.exit_code != 0, why


@pytest.fixture
async def task(client: DSecClient, busybox_image: str) -> AsyncIterator[Task]:
    answer = "ANSWER-" + secrets.token_hex(8)
    job = "forge-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(
        container_image=busybox_image,
        memory_limit_mb=128,
        pids_limit=256,
        job_id=job,
        protected=[
            ProtectedMount(
                path="/grader",
                files={"expected.txt": answer, "data.sh": GRADE_DATA, "code.sh": GRADE_CODE},
            )
        ],
    )
    sb = await client.run_container(spec)
    try:
        await sb.run_shell("mkdir -p /work && echo wrong > /work/answer.txt")
        yield Task(client, sb, answer, job)
    finally:
        with contextlib.suppress(DSecError):
            await sb.stop()


async def test_an_honest_answer_passes_in_both_modes(task: Task) -> None:
    await task.sh(
        f"echo {task.answer} > /work/answer.txt; echo 'echo {task.answer}' > /work/solution.sh"
    )
    v = await task.verify("sh /grader/data.sh", mode="isolated")
    assert (v.passed, v.stdout) == (True, "PASS\n"), v.stderr
    v = await task.verify("sh /grader/code.sh", mode="isolated")
    assert (v.passed, v.stdout) == (True, "PASS\n"), v.stderr
    assert (await task.sh("echo still here")).strip() == "still here"  # isolated: goes on
    v = await task.verify("sh /grader/data.sh")  # fresh (the default): the sandbox ends
    assert v.passed and v.mode == "fresh"
    info = await task.client.get(task.sb.id)
    assert info.info.state.value == "stopped" and "fresh verify" in (info.info.reason or "")


# ---- class 1: the world the grader runs in -------------------------------------------

WORLD_ATTACKS = {
    # The grader's shell itself.
    "replace /bin/sh": f"rm /bin/sh && printf '{FORGE_PASS}' > /bin/sh && chmod 755 /bin/sh",
    # A tool the grader uses: both sides of its comparison read the same.
    "replace /bin/cat": "rm /bin/cat && printf '#!/bin/busybox sh\\necho same\\n' > /bin/cat"
    " && chmod 755 /bin/cat",
    # A shadow earlier in PATH than the real tool.
    "shadow in /usr/local/bin": "mkdir -p /usr/local/bin &&"
    " printf '#!/bin/busybox sh\\necho same\\n' > /usr/local/bin/cat &&"
    " chmod 755 /usr/local/bin/cat",
    # The multi-call binary every applet is.
    "replace /bin/busybox": "mkdir -p /opt/r && cp /bin/busybox /opt/r/busybox &&"
    " printf '#!/opt/r/busybox sh\\necho PASS\\n' > /opt/r/new && chmod 755 /opt/r/new &&"
    " /opt/r/busybox mv /opt/r/new /bin/busybox",
    # The runner the platform hands graders for the agent's code.
    "fake $DSEC_UNTRUSTED": "mkdir -p /.dsec 2>/dev/null;"
    " printf '#!/bin/busybox sh\\nexec \"$@\"\\n' > /.dsec/untrusted;"
    " chmod 755 /.dsec/untrusted; true",
    # Shell start-up files and environment hooks.
    "profile and ENV hooks": "printf 'echo PASS; exit 0\\n' > /etc/profile; mkdir -p /root;"
    " printf 'echo PASS; exit 0\\n' > /root/.profile;"
    " printf 'ENV=/etc/profile\\n' >> /etc/environment",
}


# Shown to forge a grader that runs in the agent's world (busybox's ash runs applets
# such as cat in-process, so the cat attacks are live only in images with a real cat:
# see the Debian test below).
FORGES_IN_THE_AGENTS_WORLD = {"replace /bin/sh", "replace /bin/busybox"}


@pytest.mark.parametrize("attack", sorted(WORLD_ATTACKS))
async def test_the_agents_binaries_and_hooks_never_run_in_the_grader(
    task: Task, attack: str
) -> None:
    await task.sh(WORLD_ATTACKS[attack])
    if attack in FORGES_IN_THE_AGENTS_WORLD:
        # The attack is live: the same grader run in the agent's own world says PASS.
        await task.sh("mkdir -p /tmp/g && echo other > /tmp/g/expected.txt")
        grader = GRADE_DATA.replace("/grader/expected.txt", "/tmp/g/expected.txt")
        await task.sb.write_file("/tmp/g/data.sh", grader.encode())
        assert "PASS" in await task.sh("sh /tmp/g/data.sh"), attack
    await task.sh("echo 'cat /grader/expected.txt' > /work/solution.sh 2>/dev/null; true")
    v = await task.verify("sh /grader/data.sh", mode="isolated")
    assert_fail(v, attack)
    v = await task.verify("sh /grader/code.sh")
    assert_fail(v, attack)


async def test_a_binary_changed_behind_the_last_command_is_reported_before_verify(
    task: Task,
) -> None:
    """A background process swaps /bin/cat after the last command returned: the
    pre-verify scan reports it, and the grader still runs the pristine cat."""
    await task.sh(
        "(sleep 0.5; rm -f /bin/cat; printf '#!/bin/busybox sh\\necho same\\n' > /bin/cat;"
        " chmod 755 /bin/cat) >/dev/null 2>&1 &"
    )
    await asyncio.sleep(1.0)
    v = await task.verify("sh /grader/data.sh")
    assert_fail(v, "late binary swap")
    await task.event(EventKind.BINARY_TAMPERING, "/bin/cat")


# ---- class 2: graded files that point somewhere else ----------------------------------

LINK_ATTACKS = {
    "absolute link to the answer": "ln -sf /grader/expected.txt /work/answer.txt",
    "relative link out of the tree": "ln -sf ../grader/expected.txt /work/answer.txt",
    "through a linked directory": "ln -s /grader /work/g && ln -sf g/expected.txt /work/answer.txt",
    "dot-dot after an inner link": "mkdir -p /work/sub && ln -s .. /work/sub/up &&"
    " ln -sf sub/up/../../grader/expected.txt /work/answer.txt",
    "through /proc": "ln -sf /proc/1/root/grader/expected.txt /work/answer.txt",
    "the graded directory is a link": "rm -rf /work && ln -s /grader /work",
    "a link loop": "ln -s loop2 /work/loop1 && ln -s loop1 /work/loop2 &&"
    " ln -sf loop1 /work/answer.txt",
}


@pytest.mark.parametrize("attack", sorted(LINK_ATTACKS))
async def test_graded_links_are_inspected_not_followed(task: Task, attack: str) -> None:
    out = await task.sh(LINK_ATTACKS[attack] + " && echo planted")
    assert "planted" in out, out
    v = await task.verify("sh /grader/data.sh")
    assert_fail(v, attack)
    assert task.answer not in v.stdout + v.stderr
    assert v.refused, f"{attack}: nothing was reported as left out"
    await task.event(EventKind.GRADED_LINK_ESCAPE)


async def test_a_fifo_cannot_hang_the_grader(task: Task) -> None:
    await task.sh("rm /work/answer.txt && mkfifo /work/answer.txt")
    v = await task.verify("sh /grader/data.sh")
    assert_fail(v, "fifo")
    assert not v.timed_out and any("fifo" in r.reason for r in v.refused)


async def test_links_inside_the_tree_still_work(task: Task) -> None:
    await task.sh(
        f"mkdir -p /work/out && echo {task.answer} > /work/out/real.txt &&"
        " rm /work/answer.txt && ln -s out/real.txt /work/answer.txt"
    )
    v = await task.verify("sh /grader/data.sh")
    assert v.passed and v.refused == [], v


# ---- class 3: the agent's own code, run by the grader --------------------------------

CODE_ATTACKS = {
    "read the answer": "cat /grader/expected.txt",
    "read it through /proc": "cat /proc/1/root/grader/expected.txt"
    " /proc/*/root/grader/expected.txt",
    "search the disk": "find / -name expected.txt -exec cat {} \\; 2>/dev/null",
    "read the grader's environment": "cat /proc/*/environ /proc/*/cmdline 2>/dev/null"
    " | tr '\\0' '\\n'",
    "forge the result directory": "echo PASS > $DSEC_RESULT_DIR/verdict;"
    " echo PASS > /.dsec/result/x; cat /.dsec/verify/hidden",
    "kill the grader": "kill -9 -1; kill -9 $PPID; kill -TERM 1; echo PASS",
    "become root again": "su -c 'cat /grader/expected.txt';"
    " busybox chroot / cat /grader/expected.txt",
}


@pytest.mark.parametrize("attack", sorted(CODE_ATTACKS))
async def test_the_agents_code_cannot_read_the_answer_or_forge_the_result(
    task: Task, attack: str
) -> None:
    await task.sb.write_file("/work/solution.sh", CODE_ATTACKS[attack].encode())
    v = await task.verify(
        "sh /grader/code.sh; rc=$?; echo graded > $DSEC_RESULT_DIR/by-grader; exit $rc",
        mode="isolated",
    )
    assert_fail(v, attack)
    assert task.answer not in v.stdout + v.stderr, attack
    assert v.results == {"by-grader": "graded\n"}, v.results  # only the grader wrote
    if attack == "kill the grader":  # refused, and the attempt is the sandbox's
        await task.event(EventKind.SIGNAL_TO_INIT)


async def test_without_the_runner_the_same_code_would_forge(task: Task) -> None:
    """The control for the attacks above: a grader that runs the agent's code as root
    hands it the answer. That is why graders run it through $DSEC_UNTRUSTED."""
    await task.sb.write_file("/work/solution.sh", b"cat /grader/expected.txt")
    v = await task.verify(
        'out=$(sh /work/solution.sh); [ "$out" = "$(cat /grader/expected.txt)" ]',
        mode="isolated",
    )
    assert v.passed


async def test_the_agents_code_leaves_nothing_running(task: Task) -> None:
    await task.sb.write_file(
        "/work/solution.sh",
        b"(setsid sleep 300 &) ; (sleep 301 &) ; nohup sleep 302 >/dev/null 2>&1 & echo out",
    )
    v = await task.verify(
        "$DSEC_UNTRUSTED sh /work/solution.sh; ps -o user,args | grep -c '[s]leep 30'",
        mode="isolated",
    )
    assert v.stdout.strip().splitlines()[-1] == "0", v.stdout


async def test_the_agents_code_runs_unprivileged_with_the_graded_tree_read_only(
    task: Task,
) -> None:
    await task.sb.write_file("/work/solution.sh", b"id -u; touch /work/x 2>&1 || echo ro")
    v = await task.verify("$DSEC_UNTRUSTED sh /work/solution.sh", mode="isolated")
    assert v.stdout.splitlines()[0] == "65534" and "ro" in v.stdout, v.stdout


# ---- class 4: acting behind the grader's back ----------------------------------------


async def test_the_graders_home_is_not_the_agents(task: Task) -> None:
    """/root is graded by default; the grader's HOME is a fresh directory, so tools that
    read ~/.gitconfig, ~/.npmrc or pip.conf do not take the agent's."""
    await task.sh("printf '[alias]\\n\\tstatus = !echo PASS\\n' > /root/.gitconfig; true")
    v = await task.verify(
        'echo "$HOME"; ls -A "$HOME"; test -e /root/.gitconfig && echo graded', mode="isolated"
    )
    assert v.stdout.splitlines() == ["/.dsec/home", "graded"], v.stdout
    v = await task.verify("$DSEC_UNTRUSTED sh -c 'echo $HOME'")
    assert v.stdout == "/tmp\n", v.stdout


async def test_nothing_is_shared_with_the_agent(task: Task) -> None:
    """No shared /tmp, /dev/shm, processes or abstract sockets between agent and
    grader: the agent's planted answers and listeners are not there."""
    await task.sh(
        f"echo {task.answer} > /tmp/a; echo {task.answer} > /dev/shm/a;"
        " (nc -lk -s 127.0.0.1 -p 7777 -e cat /grader/expected.txt >/dev/null 2>&1 &);"
        " (sleep 300 &) ; true"
    )
    v = await task.verify(
        "cat /tmp/a /dev/shm/a 2>/dev/null; ps -o comm | grep -c sleep;"
        " nc -w 1 127.0.0.1 7777 </dev/null 2>/dev/null; true",
        graded=["/work"],
        mode="isolated",
    )
    assert task.answer not in v.stdout and v.stdout.strip().splitlines()[0] == "0", v.stdout


async def test_a_fresh_verify_stops_the_agent_before_the_grader_starts(
    task: Task, platform: PlatformProcess
) -> None:
    """The agent keeps a writer running; in fresh mode it is dead before the grader
    reads, so it can neither change the answer mid-grade nor see anything after."""
    await task.sh(
        "(while :; do echo wrong > /work/answer.txt; date +%s%N >> /work/ticks; usleep 10000;"
        " done) >/dev/null 2>&1 &"
    )
    v = await task.verify("sleep 0.3; sh /grader/data.sh")
    assert_fail(v, "background writer")
    info = (await task.client.get(task.sb.id)).info
    assert info.state.value == "stopped"
    with pytest.raises(SandboxNotRunning):
        await task.sb.run_shell("true")


async def test_bad_graded_input_is_refused_before_the_sandbox_is_touched(task: Task) -> None:
    for graded in (["/"], ["/usr/lib"], ["/grader"], ["/grader/x"], ["relative"], ["/a/../b"]):
        with pytest.raises(InvalidArgument):
            await task.verify("true", graded=graded)
    assert (await task.sh("echo alive")).strip() == "alive"  # not stopped by a refusal


async def test_a_graded_tree_past_the_bounds_fails_closed(
    client: DSecClient, busybox_image: str
) -> None:
    """Deeper than the snapshot walks: the grader does not run, the verdict is FAIL
    and an event says the tree could not be taken (never a partial tree graded)."""
    job = "deep-" + secrets.token_hex(4)
    sb = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=128, job_id=job)
    )
    try:
        await sb.run_shell(
            "mkdir -p /work && cd /work && i=0; while [ $i -lt 300 ]; do mkdir d && cd d;"
            " i=$((i+1)); done; echo x > leaf",
            timeout=120,
        )
        v = await sb.verify("echo PASS", graded=["/work"])
        assert not v.passed and v.error and "deeper" in v.error, v
        for _ in range(60):
            if await client.events(job=job, kinds=[EventKind.SCAN_INCOMPLETE]):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("no scan_incomplete event")
    finally:
        await sb.stop()


# ---- the agent's changes over a pristine repository ----------------------------------


async def test_changes_over_a_pristine_repository_are_exact(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    """Only the agent's changes are copied; what it deleted stays deleted (whiteouts),
    a directory it re-made hides the pristine one (opaque), and a link it put in place
    of a pristine file hides that file instead of letting it show through."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "keep.txt").write_text("pristine\n")
    (repo / "gone.txt").write_text("pristine\n")
    (repo / "answer.txt").write_text("pristine answer\n")
    (repo / "tests" / "t1").write_text("pristine test\n")
    layer = await client.build_layer("verify-repo:v1", "dir", str(repo), prefix="/work")
    sb = await client.run_container(
        DSecContainerRunArgs(
            container_image=busybox_image,
            workspace=layer.ref,
            memory_limit_mb=128,
            protected=[ProtectedMount(path="/grader", files={"expected.txt": "secret"})],
        )
    )
    try:
        await sb.run_shell(
            "cd /work && rm gone.txt && echo new > new.txt && rm -rf tests && mkdir tests &&"
            " echo mine > tests/t2 && rm answer.txt && ln -s /grader/expected.txt answer.txt"
        )
        v = await sb.verify(
            "cd /work && for f in keep.txt gone.txt new.txt tests/t1 tests/t2 answer.txt; do"
            ' printf "%s=" $f; cat $f 2>/dev/null || echo missing; done',
            graded=["/work"],
        )
        assert v.stdout.splitlines() == [
            "keep.txt=pristine",
            "gone.txt=missing",
            "new.txt=new",
            "tests/t1=missing",
            "tests/t2=mine",
            "answer.txt=missing",
        ], v.stdout
        assert [r.path for r in v.refused] == ["/work/answer.txt"]
    finally:
        await sb.stop()
