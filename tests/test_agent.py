"""The native sandbox agent (dsec-init) and its client, run for real.

Each test starts its own agent on a listening unix socket, either as an ordinary child
process or as pid 1 of a fresh pid namespace (what it is inside a container), and kills
it and everything it started afterwards, whether the test passed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import linux
from dsec.agent import build
from dsec.errors import (
    BackendError,
    FileNotFound,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
)
from dsec.sessions import protocol as p
from dsec.sessions.agent_client import AgentClient, AgentExecResult, _ExecStream

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent switches users: needs root"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the agent"),
]

MiB = 1 << 20
NOBODY = 65534


# --------------------------------------------------------------------------------------
# helpers


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process on the host."""
    return {pid: (st.ppid, st.state) for pid, st in linux.proc_stats()}


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def descendants(root: int) -> set[int]:
    """Every process under ``root`` but its idle spare supervisor (``dsec-spare``: the
    agent keeps one ready between commands; nothing a command left behind)."""
    table = _proc_table()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return {pid for pid in found if not (table[pid][0] == root and comm(pid) == "dsec-spare")}


def spares(root: int) -> list[int]:
    """The agent's idle spare supervisors (at most one)."""
    return [
        pid
        for pid, (ppid, state) in _proc_table().items()
        if ppid == root and state != "Z" and comm(pid) == "dsec-spare"
    ]


def with_marker(marker: str) -> list[int]:
    """Live (non-zombie) `sleep <marker>` processes."""
    pids = []
    for pid, (_, state) in _proc_table().items():
        if state == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if cmdline.endswith(b"sleep\0" + marker.encode() + b"\0"):
            pids.append(pid)
    return pids


def unique_sleep() -> str:
    """A `sleep` duration nobody else uses, so its processes can be found in /proc."""
    return str(900000 + secrets.randbelow(90000))


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def smaps_rollup(pid: int) -> dict[str, int]:
    """Memory totals of a process in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        return {
            line.split(":")[0]: int(line.split()[1]) for line in fh if line.rstrip().endswith("kB")
        }


async def wait_until(predicate: object, timeout: float = 5.0) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


@dataclass
class Agent:
    client: AgentClient
    proc: subprocess.Popen[bytes]
    pid: int
    """Host pid of dsec-init itself."""
    workdir: Path
    pid_namespace: bool

    async def run(self, *argv: str, user: str = "root", **kw: object) -> AgentExecResult:
        """exec() with test defaults."""
        args: dict[str, object] = {
            "env": {},
            "cwd": "",
            "timeout": 30.0,
            "max_output": 16 * MiB,
            "stdin": None,
        }
        args.update(kw)
        return await self.client.exec(list(argv), user=user, **args)  # type: ignore[arg-type]

    def log(self) -> str:
        return (self.workdir / "agent.log").read_text(errors="replace")


@contextlib.contextmanager
def running_agent(
    binary: Path, *, pid_namespace: bool, env_extra: dict[str, str] | None = None
) -> Iterator[Agent]:
    workdir = Path(tempfile.mkdtemp(prefix="dsec-agent-", dir="/tmp"))
    workdir.chmod(0o755)
    sock_path = workdir / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    proc: subprocess.Popen[bytes] | None = None
    agent_pid = 0
    try:
        listener.bind(str(sock_path))
        listener.listen(512)
        fd = listener.fileno()
        with open(workdir / "agent.log", "wb") as log:
            if pid_namespace:
                # As in a container: the socket at fd 3, the agent as pid 1. --kill-child
                # makes the namespace die with unshare whatever happens to the test.
                argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", str(binary)]
                env = {"DSEC_AGENT_FD": "3", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
                env.update(env_extra or {})
                proc = subprocess.Popen(
                    argv,
                    pass_fds=[fd, 3],  # the original fd stays open too: the agent closes it
                    preexec_fn=lambda: os.dup2(fd, 3),
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            else:
                argv = [str(binary)]
                env = {"DSEC_AGENT_FD": str(fd), **(env_extra or {})}
                proc = subprocess.Popen(argv, pass_fds=[fd], env=env, stdout=log, stderr=log)
        listener.close()
        if pid_namespace:
            deadline = time.monotonic() + 5
            while not agent_pid and time.monotonic() < deadline:
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                comm = Path(f"/proc/{children[0]}/comm").read_text() if children else ""
                agent_pid = int(children[0]) if comm.startswith("dsec-init") else 0
                time.sleep(0.005)
            assert agent_pid, "the agent did not start in its pid namespace: " + (
                workdir / "agent.log"
            ).read_text(errors="replace")
        else:
            agent_pid = proc.pid
        yield Agent(AgentClient(sock_path), proc, agent_pid, workdir, pid_namespace)
    finally:
        listener.close()
        if proc is not None:
            left = descendants(agent_pid) if agent_pid else set()
            if pid_namespace:
                proc.kill()  # unshare's death kills pid 1, which kills the namespace
            else:
                proc.terminate()  # the agent kills its descendants on SIGTERM
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pid in left:  # the safety net for a broken agent
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    old = os.environ.get("DSEC_CACHE_DIR")
    os.environ["DSEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return build.agent_binary()
    finally:
        if old is None:
            del os.environ["DSEC_CACHE_DIR"]
        else:
            os.environ["DSEC_CACHE_DIR"] = old


@pytest.fixture
def agent(agent_bin: Path) -> Iterator[Agent]:
    with running_agent(agent_bin, pid_namespace=False) as a:
        yield a


@pytest.fixture
def ns_agent(agent_bin: Path) -> Iterator[Agent]:
    with running_agent(agent_bin, pid_namespace=True) as a:
        yield a


@pytest.fixture(params=["child", "pid1"])
def any_agent(request: pytest.FixtureRequest, agent_bin: Path) -> Iterator[Agent]:
    with running_agent(agent_bin, pid_namespace=request.param == "pid1") as a:
        yield a


# --------------------------------------------------------------------------------------
# build


def test_build_is_cached_and_thread_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build.agent_binary())) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    binary = results[0]
    assert binary.name == f"dsec-init-{build.source_digest()}"
    assert binary.parent == tmp_path / "agent"
    assert os.access(binary, os.X_OK)
    assert [f.name for f in binary.parent.iterdir() if f.name.endswith(".tmp")] == []
    mtime = binary.stat().st_mtime_ns
    assert build.agent_binary() == binary and binary.stat().st_mtime_ns == mtime


def test_build_failure_raises_with_gcc_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "dsec-init.c"
    bad.write_text("int main(void) { return undefined_thing; }\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(BackendError, match="undefined_thing"):
        build.agent_binary()
    assert not any((tmp_path / "cache" / "agent").glob("dsec-init-*"))


# --------------------------------------------------------------------------------------
# commands


async def test_ping(any_agent: Agent) -> None:
    await any_agent.client.ping()


async def test_echo_round_trip(any_agent: Agent) -> None:
    res = await any_agent.run("echo", "hello", "world")
    assert res == AgentExecResult(0, b"hello world\n", b"", res.duration, False, False)
    assert 0 < res.duration < 10


async def test_exit_codes(any_agent: Agent) -> None:
    for code in (0, 1, 42, 255):
        assert (await any_agent.run("sh", "-c", f"exit {code}")).exit_code == code
    killed = await any_agent.run("sh", "-c", "kill -TERM $$")
    assert killed.exit_code == 128 + signal.SIGTERM and not killed.timed_out


async def test_stdout_stderr_separation_and_order(agent: Agent) -> None:
    res = await agent.run("sh", "-c", "echo out1; echo err1 >&2; echo out2; echo err2 >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr) == (3, b"out1\nout2\n", b"err1\nerr2\n")
    # Chunks arrive in the order the command wrote them (pauses make the order defined).
    request = p.ExecRequest(
        argv=[
            "sh",
            "-c",
            "echo a; sleep 0.1; echo b >&2; sleep 0.1; echo c; sleep 0.1; echo d >&2",
        ],
        env={},
        cwd="",
        user="root",
        timeout_ms=10000,
        max_output=MiB,
        with_stdin=False,
    )
    async with await _ExecStream.start(agent.client.socket_path, request) as stream:
        assert stream.pid > 0
        chunks = [chunk async for chunk in stream.chunks()]
        assert stream.status is not None and stream.status.exit_code == 0
    assert chunks == [(1, b"a\n"), (2, b"b\n"), (1, b"c\n"), (2, b"d\n")]


async def test_binary_output_is_exact(agent: Agent) -> None:
    data = bytes(range(256)) * 4096 + os.urandom(MiB + 17)
    src = agent.workdir / "blob"
    src.write_bytes(data)
    res = await agent.run("cat", str(src))
    assert res.stdout == data and not res.truncated
    both = await agent.run("sh", "-c", f"cat {src} >&2")
    assert both.stderr == data and both.stdout == b""


async def test_huge_output_is_truncated_and_agent_stays_small(agent: Agent) -> None:
    res = await agent.run("head", "-c", str(50 * MiB), "/dev/zero", max_output=MiB)
    assert res.exit_code == 0
    assert res.truncated and len(res.stdout) == MiB and res.stdout == bytes(MiB)
    # the cap is on stdout + stderr together
    res = await agent.run(
        "sh", "-c", "head -c 700000 /dev/zero; head -c 700000 /dev/zero >&2", max_output=MiB
    )
    assert res.truncated and len(res.stdout) + len(res.stderr) == MiB
    res = await agent.run("echo", "x", max_output=0)
    assert res.truncated and res.stdout == b""
    exact = await agent.run("head", "-c", "1000", "/dev/zero", max_output=1000)
    assert not exact.truncated and len(exact.stdout) == 1000
    # bytes beyond the cap are dropped, never buffered
    hwm = vm_kib(agent.pid, "VmHWM")
    print(f"\nagent VmHWM after 50 MB of output: {hwm} KiB")
    assert hwm < 4 * 1024


async def test_stdin(agent: Agent) -> None:
    assert (await agent.run("cat", stdin=b"hello\n")).stdout == b"hello\n"
    assert (await agent.run("cat", stdin=b"")).stdout == b""
    no_stdin = await agent.run("cat", timeout=5)  # /dev/null-like: EOF at once
    assert no_stdin.stdout == b"" and not no_stdin.timed_out
    big = os.urandom(5 * MiB)  # far beyond pipe and socket buffers
    res = await agent.run("sha256sum", stdin=big)
    assert res.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()
    echoed = await agent.run("cat", stdin=big)
    assert echoed.stdout == big
    # a command that ignores its stdin still finishes
    ignored = await agent.run("true", stdin=big)
    assert ignored.exit_code == 0


async def test_timeout_kills_setsid_and_daemonized_grandchildren(agent: Agent) -> None:
    mark = unique_sleep()
    script = (
        f"setsid sleep {mark} & "
        f"(setsid sh -c 'sleep {mark} & sleep {mark}' &) ; "
        f"sh -c '(sleep {mark} &)' ; "
        f"sleep {mark} & "
        f"echo started; sleep {mark}"
    )
    start = time.monotonic()
    res = await agent.run("sh", "-c", script, timeout=0.5)
    elapsed = time.monotonic() - start
    assert res.timed_out and res.exit_code == 137
    assert res.stdout == b"started\n"
    assert elapsed < 10
    assert with_marker(mark) == [], "a process of the timed-out command survived"
    assert descendants(agent.pid) == set()


async def test_timeout_in_pid_namespace(ns_agent: Agent) -> None:
    mark = unique_sleep()
    res = await ns_agent.run("sh", "-c", f"(setsid sleep {mark} &); sleep {mark}", timeout=0.3)
    assert res.timed_out and res.exit_code == 137
    assert with_marker(mark) == []


async def test_background_process_survives_and_call_returns_quickly(agent: Agent) -> None:
    mark = unique_sleep()
    start = time.monotonic()
    res = await agent.run("sh", "-c", f"sleep {mark} & echo started")
    elapsed = time.monotonic() - start
    assert res.exit_code == 0 and res.stdout == b"started\n" and not res.timed_out
    assert elapsed < 2, f"the call waited {elapsed:.2f}s for a pipe held by a background process"
    # the shell may return before its background child has exec'd sleep
    assert await wait_until(lambda: len(with_marker(mark)) == 1)
    (bg,) = with_marker(mark)
    assert _proc_table()[bg][0] == agent.pid, "orphans must be reparented to the agent"
    os.kill(bg, signal.SIGKILL)
    # the agent reaps it: no zombie stays behind
    assert await wait_until(lambda: bg not in _proc_table())


async def test_start_failures_are_typed(agent: Agent) -> None:
    with pytest.raises(InvalidArgument, match="unknown user 'nosuchuser'"):
        await agent.run("true", user="nosuchuser")
    with pytest.raises(InvalidArgument, match="invalid user"):
        await agent.run("true", user="12:ab")
    with pytest.raises(FileNotFound, match="working directory"):
        await agent.run("true", cwd="/nonexistent/dir")
    with pytest.raises(InvalidArgument, match="working directory"):
        await agent.run("true", cwd="/etc/passwd")
    with pytest.raises(FileNotFound, match="program 'no-such-program-xyz' not found"):
        await agent.run("no-such-program-xyz")
    with pytest.raises(FileNotFound):
        await agent.run("/no/such/path")
    noexec = agent.workdir / "noexec"
    noexec.write_text("#!/bin/sh\necho hi\n")
    noexec.chmod(0o644)
    with pytest.raises(PermissionDenied):
        await agent.run(str(noexec))
    with pytest.raises(InvalidArgument):
        await agent.run()
    with pytest.raises(InvalidArgument):
        await agent.run("true", env={"A=B": "x"})
    with pytest.raises(InvalidArgument):
        await agent.run("true", timeout=-1)
    # the agent still serves after all of that
    assert (await agent.run("true")).exit_code == 0


async def test_user_env_and_cwd(agent: Agent) -> None:
    res = await agent.run(
        "sh", "-c", "id -u; id -g; pwd; echo $HOME $USER $LOGNAME; echo $PATH", user="nobody"
    )
    uid, gid, cwd, names, path = res.stdout.decode().splitlines()
    assert (uid, gid) == ("65534", "65534")
    assert cwd == "/"  # nobody's home (/nonexistent) does not exist
    assert names == "/nonexistent nobody nobody"
    assert "/usr/bin" in path
    res = await agent.run("sh", "-c", "id -u; id -g; id -G", user="1234:2345")
    assert res.stdout.decode().split() == ["1234", "2345", "2345"]
    res = await agent.run(
        "sh",
        "-c",
        "echo $HOME:$PATH:$FOO; pwd",
        env={"PATH": "/bin:/usr/bin", "FOO": "bar"},
        cwd="/tmp",
    )
    assert res.stdout == b"/root:/bin:/usr/bin:bar\n/tmp\n"
    res = await agent.run(
        "env", env={"ONLY": "1", "HOME": "/h", "USER": "u", "LOGNAME": "l", "PATH": "/bin"}
    )
    assert sorted(res.stdout.decode().split()) == [
        "HOME=/h",
        "LOGNAME=l",
        "ONLY=1",
        "PATH=/bin",
        "USER=u",
    ]
    # scripts without #! run with /bin/sh, as execvp does
    script = agent.workdir / "script"
    script.write_text("echo from-script\n")
    script.chmod(0o755)
    assert (await agent.run(str(script))).stdout == b"from-script\n"


async def test_commands_do_not_inherit_agent_fds(any_agent: Agent) -> None:
    res = await any_agent.run("sh", "-c", "ls /proc/$$/fd")
    assert res.stdout.split() == [b"0", b"1", b"2"]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
async def test_agent_is_not_dumpable(ns_agent: Agent) -> None:
    # root inside without CAP_SYS_PTRACE cannot reach pid 1's fds (its listening socket)
    drop = ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"]
    res = await ns_agent.run(*drop, "readlink", "-v", "/proc/1/fd/3")
    assert res.exit_code != 0 and b"Permission denied" in res.stderr
    ok = await ns_agent.run(*drop, "readlink", "/proc/self/fd/1")
    assert ok.exit_code == 0 and ok.stdout.startswith(b"pipe:")
    # (with CAP_SYS_PTRACE, which sandboxes do not get, it would be reachable)
    assert (await ns_agent.run("readlink", "/proc/1/fd/3")).stdout.startswith(b"socket:")


async def test_signal_reaches_the_whole_tree(agent: Agent) -> None:
    mark = unique_sleep()
    request = p.ExecRequest(
        argv=["sh", "-c", f"setsid sleep {mark} & sleep {mark}"],
        env={},
        cwd="",
        user="root",
        timeout_ms=0,
        max_output=MiB,
        with_stdin=False,
    )
    async with await _ExecStream.start(agent.client.socket_path, request) as stream:
        assert await wait_until(lambda: len(with_marker(mark)) == 2)
        await stream.send_signal(signal.SIGTERM)
        assert await stream.next_chunk() is None
        assert stream.status is not None and stream.status.exit_code == 128 + signal.SIGTERM
    assert await wait_until(lambda: with_marker(mark) == [])


async def test_interactive_stdin(agent: Agent) -> None:
    request = p.ExecRequest(
        argv=["sh", "-c", "while read line; do echo got:$line; done; echo bye"],
        env={},
        cwd="",
        user="root",
        timeout_ms=10000,
        max_output=MiB,
        with_stdin=True,
    )
    async with await _ExecStream.start(agent.client.socket_path, request) as stream:
        await stream.write_stdin(b"one\n")
        assert await stream.next_chunk() == (1, b"got:one\n")
        await stream.write_stdin(b"two\n")
        assert await stream.next_chunk() == (1, b"got:two\n")
        await stream.close_stdin()
        assert await stream.next_chunk() == (1, b"bye\n")
        assert await stream.next_chunk() is None
        assert stream.status is not None and stream.status.exit_code == 0


async def test_client_disconnect_kills_the_tree(agent: Agent) -> None:
    mark = unique_sleep()
    request = p.ExecRequest(
        argv=["sh", "-c", f"(setsid sleep {mark} &); sleep {mark}"],
        env={},
        cwd="",
        user="root",
        timeout_ms=0,
        max_output=MiB,
        with_stdin=False,
    )
    stream = await _ExecStream.start(agent.client.socket_path, request)
    assert await wait_until(lambda: len(with_marker(mark)) == 2)
    await stream.aclose()
    assert await wait_until(lambda: with_marker(mark) == [])
    assert await wait_until(lambda: descendants(agent.pid) == set())


async def test_cancelled_exec_kills_the_command(agent: Agent) -> None:
    mark = unique_sleep()
    task = asyncio.create_task(agent.run("sleep", mark))
    assert await wait_until(lambda: len(with_marker(mark)) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until(lambda: with_marker(mark) == [])


async def test_100_concurrent_execs(agent: Agent) -> None:
    results = await asyncio.gather(
        *(agent.run("sh", "-c", 'sleep 0.2; echo "$0"; echo "e$0" >&2', str(i)) for i in range(100))
    )
    for i, res in enumerate(results):
        assert (res.exit_code, res.stdout, res.stderr) == (0, f"{i}\n".encode(), f"e{i}\n".encode())
    assert await wait_until(lambda: descendants(agent.pid) == set())


# --------------------------------------------------------------------------------------
# the spare supervisor (forked while idle; the next command starts without a fork)


async def test_the_next_command_is_supervised_by_the_spare(agent: Agent) -> None:
    assert (await agent.run("true")).exit_code == 0
    assert await wait_until(lambda: len(spares(agent.pid)) == 1), "no spare after a command"
    (spare,) = spares(agent.pid)
    # it holds its socket only: no client connection or command pipe of the agent's
    assert os.listdir(f"/proc/{spare}/fd") == ["5"]
    res = await agent.run("sh", "-c", "echo $PPID; cat /proc/$PPID/comm")
    assert res.stdout.decode().split() == [str(spare), "dsec-init"], res
    # used once: it is gone (reaped, not a zombie) and a new one waits
    assert await wait_until(lambda: spare not in _proc_table())
    assert await wait_until(lambda: spares(agent.pid) not in ([], [spare]))


async def test_a_killed_spare_is_reaped_and_commands_still_start(any_agent: Agent) -> None:
    assert (await any_agent.run("true")).exit_code == 0
    assert await wait_until(lambda: len(spares(any_agent.pid)) == 1)
    (spare,) = spares(any_agent.pid)
    os.kill(spare, signal.SIGKILL)
    assert await wait_until(lambda: spare not in _proc_table()), "the dead spare was not reaped"
    res = await any_agent.run("sh", "-c", "echo ok; exit 3")
    assert (res.exit_code, res.stdout) == (3, b"ok\n")
    assert await wait_until(lambda: len(spares(any_agent.pid)) == 1)


async def test_a_spare_stopped_from_inside_still_starts_the_next_command(agent: Agent) -> None:
    """Root inside can stop the idle spare; the command handed to it next (the harness's,
    not the attacker's) must start anyway: the agent wakes the spare as it hands it over."""
    assert (await agent.run("true")).exit_code == 0
    assert await wait_until(lambda: len(spares(agent.pid)) == 1)
    (spare,) = spares(agent.pid)
    os.kill(spare, signal.SIGSTOP)
    res = await asyncio.wait_for(agent.run("sh", "-c", "echo $PPID", timeout=5), 10)
    assert (res.exit_code, res.timed_out, res.stdout) == (0, False, f"{spare}\n".encode()), res


async def test_a_stopped_supervisor_is_woken_to_honour_the_timeout(agent: Agent) -> None:
    """A supervisor stopped from inside cannot kill its command at the deadline unless
    the agent wakes it: the timeout still ends the command's whole tree."""
    mark = unique_sleep()
    run = asyncio.ensure_future(agent.run("sh", "-c", f"sleep {mark}", timeout=1.0))
    assert await wait_until(lambda: len(with_marker(mark)) == 1)
    (cmd,) = with_marker(mark)
    supervisor = _proc_table()[cmd][0]
    while _proc_table().get(supervisor, (0, ""))[0] != agent.pid:  # sh's parent, or sh exec'd
        supervisor = _proc_table()[supervisor][0]
    os.kill(supervisor, signal.SIGSTOP)
    res = await asyncio.wait_for(run, 15)
    assert res.timed_out and res.exit_code == 137, res
    assert await wait_until(lambda: with_marker(mark) == [])


async def test_a_request_too_big_for_the_spare_is_forked_as_before(agent: Agent) -> None:
    assert (await agent.run("true")).exit_code == 0
    assert await wait_until(lambda: len(spares(agent.pid)) == 1)
    big = "x" * (100 * 1024)
    res = await agent.run("sh", "-c", "echo ${#BIG}; echo $PPID", env={"BIG": big})
    length, ppid = res.stdout.decode().split()
    assert length == str(len(big)) and int(ppid) not in spares(agent.pid), res


async def test_a_request_bigger_than_the_socket_buffer_arrives_whole(agent: Agent) -> None:
    # A frame the socket buffer cannot take at once goes out in parts as the agent
    # reads: every byte arrives, in order (the agent checks the frame, the shell each
    # value's length and last character).
    env = {f"V{i}": chr(ord("a") + i) * (100 * 1024) for i in range(12)}
    frame = p.encode_exec(
        p.ExecRequest(argv=["sh"], env=env, cwd="", user="root", timeout_ms=0,
                      max_output=0, with_stdin=False)
    )  # fmt: skip
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sndbuf = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    probe.close()
    assert len(frame) > 2 * sndbuf  # partial writes are exercised
    script = (
        'for v in V0 V5 V11; do eval "x=\\$$v"; echo "$v ${#x} $(printf %s "$x" | tail -c 1)"; done'
    )
    res = await agent.run("sh", "-c", script, env=env)
    assert res.exit_code == 0, res
    assert res.stdout.decode().split("\n")[:3] == [
        f"V0 {100 * 1024} a",
        f"V5 {100 * 1024} f",
        f"V11 {100 * 1024} l",
    ]


async def test_an_agent_that_hangs_up_at_once_is_a_backend_error(tmp_path: Path) -> None:
    # Accepts, then closes without reading: the request's write may fail (EPIPE, a
    # reset) or land in a buffer nobody reads; either way the caller gets the typed
    # error, for a small request and for one bigger than the socket buffer.
    path = tmp_path / "rude.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    stop = threading.Event()

    def hang_up() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    client = AgentClient(path)
    try:
        for env in ({}, {"BIG": "x" * (1 << 20)}):
            with pytest.raises(BackendError, match=r"closed the connection|reset"):
                await client.exec(
                    ["true"], env=env, cwd="", user="root", timeout=5, max_output=1,
                    stdin=None,
                )  # fmt: skip
        with pytest.raises(BackendError, match=r"closed the connection|reset"):
            await client.read_file("/etc/hostname", user="root", max_bytes=10)
    finally:
        stop.set()
        thread.join()
        server.close()


async def test_an_unused_spare_exits_after_its_idle_time(agent_bin: Path) -> None:
    with running_agent(
        agent_bin, pid_namespace=False, env_extra={"DSEC_AGENT_SPARE_IDLE_MS": "300"}
    ) as a:
        assert (await a.run("true")).exit_code == 0
        assert await wait_until(lambda: len(spares(a.pid)) == 1)
        assert await wait_until(lambda: descendants(a.pid) | set(spares(a.pid)) == set())
    with running_agent(
        agent_bin, pid_namespace=False, env_extra={"DSEC_AGENT_SPARE_IDLE_MS": "0"}
    ) as off:
        for _ in range(3):
            assert (await off.run("true")).exit_code == 0
        await asyncio.sleep(0.2)
        assert spares(off.pid) == []


async def test_zombies_are_reaped_as_pid1(ns_agent: Agent) -> None:
    # orphans that outlive their command end up with pid 1 and exit later
    res = await ns_agent.run("sh", "-c", "(sleep 0.2 &); (sleep 0.3 &); sleep 0.1 & true")
    assert res.exit_code == 0
    assert await wait_until(lambda: len(descendants(ns_agent.pid)) == 3, timeout=2)
    assert await wait_until(lambda: descendants(ns_agent.pid) == set(), timeout=5)
    # seen from inside: pid 1 is the agent, and there are no zombies at all
    listing = await ns_agent.run("sh", "-c", "cat /proc/[0-9]*/stat")
    states = {
        int(line.split()[0]): line[line.rindex(")") + 2]
        for line in listing.stdout.decode().splitlines()
    }
    # alive and not a zombie; "R" when it is relaying this very listing as it is read
    assert states[1] in ("S", "R")
    assert "Z" not in states.values()
    comm = await ns_agent.run("cat", "/proc/1/comm")
    assert comm.stdout.startswith(b"dsec-init")


async def test_sigterm_to_pid1_ends_the_sandbox(ns_agent: Agent) -> None:
    mark = unique_sleep()
    await ns_agent.run("sh", "-c", f"setsid sleep {mark} > /dev/null 2>&1 &")
    # the shell may return before its background child has exec'd sleep
    assert await wait_until(lambda: len(with_marker(mark)) == 1)
    os.kill(ns_agent.pid, signal.SIGTERM)
    assert ns_agent.proc.wait(10) == 0
    assert with_marker(mark) == []


async def test_shutdown_kills_everything_and_exits(agent: Agent) -> None:
    mark = unique_sleep()
    await agent.run("sh", "-c", f"sleep {mark} > /dev/null &")
    running = asyncio.create_task(agent.run("sleep", mark))
    assert await wait_until(lambda: len(with_marker(mark)) == 2)
    await agent.client.shutdown()
    assert agent.proc.wait(10) == 0
    assert with_marker(mark) == []
    with pytest.raises(BackendError):
        await running
    with pytest.raises(BackendError, match="not reachable"):
        await agent.client.ping()


async def test_unreachable_agent_is_a_backend_error(tmp_path: Path) -> None:
    client = AgentClient(tmp_path / "missing.sock")
    with pytest.raises(BackendError, match="sandbox agent is not reachable"):
        await client.ping()
    with pytest.raises(BackendError, match="sandbox agent is not reachable"):
        await client.exec(
            ["true"], env={}, cwd="", user="root", timeout=1, max_output=1, stdin=None
        )
    # a socket nobody listens on any more
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    with pytest.raises(BackendError, match="sandbox agent is not reachable"):
        await AgentClient(dead).read_file("/etc/hostname", user="root", max_bytes=100)
    # a listener that never answers: ping times out
    silent = tmp_path / "silent.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(silent))
    s.listen(1)
    try:
        with pytest.raises(BackendError, match="no answer to ping"):
            await AgentClient(silent).ping(timeout=0.2)
    finally:
        s.close()


async def test_latency(agent: Agent) -> None:
    for _ in range(10):
        await agent.run("echo", "hi")
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        res = await agent.run("echo", "hi")
        samples.append(time.perf_counter() - start)
        assert res.stdout == b"hi\n"
    pings = []
    for _ in range(200):
        start = time.perf_counter()
        await agent.client.ping()
        pings.append(time.perf_counter() - start)
    rollup = smaps_rollup(agent.pid)
    print(
        f"\nexec echo round trip: median {statistics.median(samples) * 1000:.2f} ms, "
        f"p99 {sorted(samples)[197] * 1000:.2f} ms; "
        f"ping median {statistics.median(pings) * 1000:.3f} ms"
        f"\nidle agent: Rss {rollup['Rss']} KiB, of which anonymous (the per-sandbox cost; "
        f"the rest are binary pages shared by every sandbox) {rollup['Anonymous']} KiB"
    )


# --------------------------------------------------------------------------------------
# files


async def test_file_round_trip(any_agent: Agent) -> None:
    c = any_agent.client
    d = any_agent.workdir
    data = bytes(range(256)) * 1000 + os.urandom(3 * MiB)
    target = d / "a" / "b" / "c.bin"
    await c.write_file(str(target), data, user="root", mode=0o640)
    assert target.read_bytes() == data
    assert (target.stat().st_mode & 0o7777) == 0o640
    assert await c.read_file(str(target), user="root", max_bytes=len(data)) == data
    # overwrite, new mode, empty content
    await c.write_file(str(target), b"", user="root", mode=0o755)
    assert target.read_bytes() == b"" and (target.stat().st_mode & 0o7777) == 0o755
    assert await c.read_file(str(target), user="root", max_bytes=0) == b""
    with pytest.raises(FileNotFound):
        await c.write_file(
            str(d / "missing" / "x"), b"x", user="root", mode=0o644, make_parents=False
        )
    assert not (d / "missing").exists()
    # nothing but the files themselves is left in the directory
    assert sorted(f.name for f in target.parent.iterdir()) == ["c.bin"]


async def test_write_is_atomic(agent: Agent) -> None:
    target = agent.workdir / "atomic"
    versions = [bytes([65 + i]) * (2 * MiB) for i in range(4)]
    target.write_bytes(versions[0])
    stop = False
    seen: set[bytes] = set()

    def reader() -> None:
        while not stop:
            content = target.read_bytes()
            assert content in versions, "a reader saw a partial or mixed file"
            seen.add(content[:1])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(20):
            await agent.client.write_file(str(target), versions[i % 4], user="root", mode=0o644)
    finally:
        stop = True
        thread.join()
    assert len(seen) > 1
    assert sorted(f.name for f in agent.workdir.iterdir() if f.name.startswith(".atomic")) == []


async def test_read_errors(agent: Agent) -> None:
    c = agent.client
    with pytest.raises(FileNotFound, match="No such file"):
        await c.read_file("/nonexistent/file", user="root", max_bytes=100)
    with pytest.raises(InvalidArgument, match="is a directory"):
        await c.read_file("/etc", user="root", max_bytes=100)
    with pytest.raises(InvalidArgument, match="absolute"):
        await c.read_file("etc/passwd", user="root", max_bytes=100)
    big = agent.workdir / "big"
    big.write_bytes(b"x" * 1000)
    with pytest.raises(LimitExceeded, match="1000 bytes"):
        await c.read_file(str(big), user="root", max_bytes=999)
    assert await c.read_file(str(big), user="root", max_bytes=1000) == b"x" * 1000
    # files whose size is unknown in advance are limited while they are read
    with pytest.raises(LimitExceeded):
        await c.read_file("/dev/zero", user="root", max_bytes=100_000)
    assert (await c.read_file("/proc/self/status", user="root", max_bytes=MiB)).startswith(b"Name:")
    with pytest.raises(InvalidArgument):
        await c.read_file("/etc/passwd", user="no-such-user", max_bytes=100)


async def test_abandoned_read_of_a_blocking_device_leaves_nothing(agent: Agent) -> None:
    master, slave = os.openpty()  # a tty never reaches EOF
    try:
        task = asyncio.create_task(
            agent.client.read_file(os.ttyname(slave), user="root", max_bytes=MiB)
        )
        assert await wait_until(lambda: len(descendants(agent.pid)) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until(lambda: descendants(agent.pid) == set())
    finally:
        os.close(master)
        os.close(slave)


async def test_write_errors(agent: Agent) -> None:
    c = agent.client
    with pytest.raises(InvalidArgument, match="absolute"):
        await c.write_file("relative", b"x", user="root", mode=0o644)
    with pytest.raises(InvalidArgument):
        await c.write_file(str(agent.workdir) + "/", b"x", user="root", mode=0o644)
    (agent.workdir / "dir").mkdir()
    with pytest.raises(InvalidArgument):
        await c.write_file(str(agent.workdir / "dir"), b"x", user="root", mode=0o644)
    (agent.workdir / "file").write_text("")
    with pytest.raises(InvalidArgument):
        await c.write_file(str(agent.workdir / "file" / "sub"), b"x", user="root", mode=0o644)
    with pytest.raises(InvalidArgument):
        await c.write_file(str(agent.workdir / "f"), b"x", user="root", mode=0o17777)


async def test_file_ops_as_non_root_are_checked_by_the_kernel(agent: Agent) -> None:
    c = agent.client
    secret = agent.workdir / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    with pytest.raises(PermissionDenied):
        await c.read_file(str(secret), user="nobody", max_bytes=100)
    assert await c.read_file(str(secret), user="root", max_bytes=100) == b"root only"
    # a root-owned 0755 directory: nobody may not create files in it
    with pytest.raises(PermissionDenied):
        await c.write_file(str(agent.workdir / "new"), b"x", user="nobody", mode=0o644)
    with pytest.raises(PermissionDenied):
        await c.write_file(str(secret), b"overwrite", user="nobody", mode=0o644)
    assert secret.read_bytes() == b"root only"
    with pytest.raises(PermissionDenied):
        await c.write_file(str(agent.workdir / "x" / "y"), b"x", user="nobody", mode=0o644)
    # where nobody may write, the file is nobody's
    shared = agent.workdir / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    await c.write_file(str(shared / "mine" / "f"), b"hi", user="nobody", mode=0o600)
    st = (shared / "mine" / "f").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600)
    assert (shared / "mine").stat().st_uid == NOBODY
    assert await c.read_file(str(shared / "mine" / "f"), user="nobody", max_bytes=10) == b"hi"
    assert await c.read_file(str(shared / "mine" / "f"), user=f"{NOBODY}", max_bytes=10) == b"hi"
    with pytest.raises(PermissionDenied):
        await c.read_file(str(shared / "mine" / "f"), user="1234:1234", max_bytes=10)


async def test_planted_symlink_is_resolved_as_the_user(agent: Agent) -> None:
    # a link planted by the sandbox's user grants nothing beyond that user's own rights
    shared = agent.workdir / "links"
    shared.mkdir()
    shared.chmod(0o777)
    secret = agent.workdir / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    (shared / "link").symlink_to(secret)
    with pytest.raises(PermissionDenied):
        await agent.client.read_file(str(shared / "link"), user="nobody", max_bytes=100)
    # writing replaces the link itself instead of writing through it
    await agent.client.write_file(str(shared / "link"), b"new", user="nobody", mode=0o644)
    assert secret.read_bytes() == b"root only"
    assert not (shared / "link").is_symlink()


async def test_concurrent_file_ops_and_execs(agent: Agent) -> None:
    c = agent.client

    async def one(i: int) -> None:
        path = str(agent.workdir / "many" / f"f{i}")
        payload = os.urandom(1000 + i)
        await c.write_file(path, payload, user="root", mode=0o644)
        assert await c.read_file(path, user="root", max_bytes=MiB) == payload
        res = await c.exec(
            ["cat", path], env={}, cwd="", user="root", timeout=10, max_output=MiB, stdin=None
        )
        assert res.stdout == payload

    await asyncio.gather(*(one(i) for i in range(50)))


# --------------------------------------------------------------------------------------
# protocol and the host-side crun wrapper


def test_frame_decoder_round_trip() -> None:
    dec = p.FrameDecoder()
    stream = p.frame(p.T_STDOUT, b"abc") + p.encode_signal(15) + p.frame(p.T_CLOSE)
    out = []
    for i in range(len(stream)):  # byte by byte
        out += dec.feed(stream[i : i + 1])
    assert out == [(p.T_STDOUT, b"abc"), (p.T_SIGNAL, (15).to_bytes(4, "little")), (p.T_CLOSE, b"")]
    assert dec.pending == 0
    with pytest.raises(p.ProtocolError):
        p.parse_header(bytes([p.T_DATA]) + (p.MAX_PAYLOAD + 1).to_bytes(4, "little"))
    assert p.decode_failure((errno.ENOENT).to_bytes(4, "little") + b"gone") == (
        errno.ENOENT,
        "gone",
    )
    with pytest.raises(ValueError):
        p.pack_str("a\0b")


def test_crun_wrap_masks_unified_controllers(agent_bin: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    target = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    before = target.read_bytes() if target.exists() else None
    out = subprocess.run(
        [
            str(agent_bin),
            "crun-wrap",
            str(empty),
            "/bin/sh",
            "-c",
            f"cat {target} 2>/dev/null; echo end",
        ],
        capture_output=True,
        check=True,
    )
    assert out.stdout == b"end\n"
    # the flag form used by the runtime layer, with the agent socket moved to fd 3
    r, w = os.pipe()
    try:
        out = subprocess.run(
            [
                str(agent_bin),
                "crun-wrap",
                "--fd",
                str(r),
                "--mask-cgroup2",
                str(empty),
                "--",
                "/bin/sh",
                "-c",
                f"cat {target} 2>/dev/null; readlink /proc/self/fd/3",
            ],
            capture_output=True,
            check=True,
            pass_fds=[r],
        )
    finally:
        os.close(r)
        os.close(w)
    assert out.stdout.startswith(b"pipe:")
    # the host's own view is unchanged
    assert (target.read_bytes() if target.exists() else None) == before
    bad = subprocess.run([str(agent_bin), "crun-wrap"], capture_output=True, check=False)
    assert bad.returncode == 125 and b"usage" in bad.stderr


def test_crun_wrap_mounts_and_fills_the_dev_tmpfs(agent_bin: Path, tmp_path: Path) -> None:
    """--dev-tmpfs: one tmpfs in the wrapper's private namespace, with the nodes and
    links crun makes in a /dev of its own (it makes none in a bound /dev) and shm."""
    dev = tmp_path / "dev"
    dev.mkdir()
    show = (
        f"grep ' {dev} ' /proc/self/mountinfo | cut -d' ' -f6-;"
        f" cd {dev} && stat -c '%n %F %t:%T %a %u:%g' shm null zero full tty random urandom;"
        " for l in fd stdin stdout stderr core ptmx; do echo $l $(readlink $l); done"
    )
    wrap = [str(agent_bin), "crun-wrap", "--dev-tmpfs", str(dev)]
    out = subprocess.run(
        [*wrap, "--dev-data", "mode=755,size=64k", "--", "/bin/sh", "-c", show],
        capture_output=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.decode()
    lines = out.splitlines()
    assert lines[0].startswith("rw,nosuid - tmpfs tmpfs rw,size=64k,mode=755"), out
    assert lines[1:8] == [
        "shm directory 0:0 1777 0:0",
        "null character special file 1:3 666 0:0",
        "zero character special file 1:5 666 0:0",
        "full character special file 1:7 666 0:0",
        "tty character special file 5:0 666 0:0",
        "random character special file 1:8 666 0:0",
        "urandom character special file 1:9 666 0:0",
    ], out
    assert lines[8:] == [
        "fd /proc/self/fd",
        "stdin /proc/self/fd/0",
        "stdout /proc/self/fd/1",
        "stderr /proc/self/fd/2",
        "core /proc/kcore",
        "ptmx pts/ptmx",
    ], out
    # Only the wrapper's namespace had it: the host's directory is empty, not a mount.
    assert not list(dev.iterdir())
    assert f" {dev} " not in Path("/proc/self/mountinfo").read_text()
    half = subprocess.run(
        [*wrap, "--", "/bin/true"],
        capture_output=True,
        check=False,
    )
    assert half.returncode == 125 and b"usage" in half.stderr
