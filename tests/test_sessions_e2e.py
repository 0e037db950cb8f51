"""Chronus sessions, streaming, processes and the terminal, end to end against a real
`dsec up` and real crun sandboxes. Nothing is mocked."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient, Sandbox, linux
from dsec.api.events import AuditKind
from dsec.errors import InvalidArgument, NotFound, SandboxNotRunning
from dsec.sdk.datapath import OutputChunk
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root


HOST_PASSWD = Path("/etc/passwd").read_bytes()


def args(image: str, **kw: object) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 128)
    return DSecContainerRunArgs.model_validate({"container_image": image, **kw})


@pytest.fixture
async def sb(client: DSecClient, busybox_image: str) -> AsyncIterator[Sandbox]:
    sandbox = await client.run_container(args(busybox_image))
    try:
        yield sandbox
    finally:
        await sandbox.stop()


def marker() -> str:
    """A `sleep` duration nobody else uses, so its processes can be found on the host."""
    return str(700000 + secrets.randbelow(99999))


def host_processes_with(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        st = linux.proc_stat(int(entry))
        if st is not None and not st.dead and mark.encode() in cmdline and b"sleep" in cmdline:
            found.append(int(entry))
    return found


async def gone(mark: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while host_processes_with(mark):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# ---- sessions -----------------------------------------------------------------------


async def test_session_state_carries_over_and_sessions_are_independent(sb: Sandbox) -> None:
    a = await sb.session()
    b = await sb.session(env={"WHO": "b"}, workdir="/etc")
    r = await a.run("mkdir -p /repo && cd /repo && export X=1 && umask 077")
    assert r.exit_code == 0
    r = await a.run("pwd; echo $X; umask")
    assert r.stdout == "/repo\n1\n0077\n"
    r = await b.run("pwd; echo ${X:-unset} $WHO")
    assert r.stdout == "/etc\nunset b\n"
    await a.run("unset X; export Y='quote \"and\" space'")
    assert (await a.run('echo "${X:-gone}" "$Y"')).stdout == 'gone quote "and" space\n'
    r = await a.run("exit 3")
    assert r.exit_code == 3
    assert (await a.run("pwd")).stdout == "/repo\n"
    assert {s.id for s in await sb.sessions()} == {a.id, b.id}
    # run_shell is a fresh process every time: no state from sessions or earlier calls.
    await sb.run_shell("cd /tmp; export Z=1")
    assert (await sb.run_shell("pwd; echo ${Z:-none}")).stdout == "/\nnone\n"
    await a.close()
    assert [s.id for s in await sb.sessions()] == [b.id]
    with pytest.raises(NotFound):
        await a.run("true")


async def test_session_timeout_kills_tree_and_session_survives(sb: Sandbox) -> None:
    mark = marker()
    sess = await sb.session()
    await sess.run("cd /tmp && export KEEP=yes")
    start = time.monotonic()
    r = await sess.run(
        f"cd /; export KEEP=no; sleep {mark} & setsid sleep {mark} & sleep {mark}", timeout=0.5
    )
    assert r.timed_out and r.exit_code == 137
    assert time.monotonic() - start < 5
    assert await gone(mark), "grandchildren of a timed-out session command survived"
    # The killed command's changes are not kept; the session goes on.
    assert (await sess.run("pwd; echo $KEEP")).stdout == "/tmp\nyes\n"


async def test_session_commands_run_one_at_a_time(sb: Sandbox) -> None:
    sess = await sb.session()
    await sess.run("echo 0 > /tmp/n")
    await asyncio.gather(
        *(sess.run("n=$(cat /tmp/n); sleep 0.01; echo $((n+1)) > /tmp/n") for _ in range(10))
    )
    assert (await sb.read_text("/tmp/n")).strip() == "10"


# ---- concurrency --------------------------------------------------------------------


async def test_100_concurrent_commands_on_one_sandbox(sb: Sandbox) -> None:
    results = await asyncio.gather(*(sb.run_shell(f"echo {i}; echo e{i} >&2") for i in range(100)))
    for i, r in enumerate(results):
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"{i}\n", f"e{i}\n")


async def test_commands_across_50_sandboxes(client: DSecClient, busybox_image: str) -> None:
    boxes = await asyncio.gather(
        *(client.run_container(args(busybox_image, memory_limit_mb=32)) for _ in range(50))
    )
    try:
        results = await asyncio.gather(
            *(b.run_shell("hostname; echo $((2+3))") for b in boxes),
            *(b.run_shell("cat /proc/1/cmdline") for b in boxes),
        )
        for b, r in zip(boxes, results[:50], strict=True):
            assert r.stdout == f"{b.id}\n5\n"
        assert all(r.stdout == "/.dsec/init\0" for r in results[50:])
    finally:
        await asyncio.gather(*(b.stop() for b in boxes))


# ---- streaming ----------------------------------------------------------------------


async def test_streaming_order_and_callbacks(sb: Sandbox) -> None:
    chunks = [
        c async for c in sb.stream("echo a; sleep 0.05; echo b >&2; sleep 0.05; echo c; exit 4")
    ]
    assert [(c.stream, c.data) for c in chunks] == [
        ("stdout", b"a\n"),
        ("stderr", b"b\n"),
        ("stdout", b"c\n"),
    ]
    seen: list[tuple[str, bytes]] = []
    r = await sb.run_shell(
        "for i in $(seq 1 200); do echo o$i; echo e$i >&2; done",
        on_stdout=lambda d: seen.append(("out", d)),
        on_stderr=lambda d: seen.append(("err", d)),
    )
    out = b"".join(d for k, d in seen if k == "out")
    err = b"".join(d for k, d in seen if k == "err")
    assert out == r.stdout_bytes == b"".join(b"o%d\n" % i for i in range(1, 201))
    assert err == r.stderr_bytes == b"".join(b"e%d\n" % i for i in range(1, 201))


async def test_first_byte_arrives_while_the_command_runs(sb: Sandbox) -> None:
    mark = marker()
    start = time.monotonic()
    stream = sb.stream(f"echo first; sleep {mark}")
    first = await anext(stream)
    assert first == OutputChunk("stdout", b"first\n")
    assert time.monotonic() - start < 2
    await stream.aclose()  # leaving early kills the command
    assert await gone(mark)


async def test_binary_and_huge_output(sb: Sandbox) -> None:
    data = bytes(range(256)) * 257 + os.urandom(70000)
    await sb.write_file("/tmp/bin", data)
    r = await sb.exec(["cat", "/tmp/bin"])
    assert r.stdout_bytes == data and not r.truncated
    r = await sb.run_shell("head -c 50000000 /dev/zero; echo done >&2", max_output_bytes=1 << 20)
    assert r.truncated and r.exit_code == 0
    assert len(r.stdout_bytes) + len(r.stderr_bytes) == 1 << 20
    proc = await sb.start("head -c 30000000 /dev/zero", max_output_bytes=100_000)
    exit_info = await proc.wait()
    assert exit_info.truncated
    info = await proc.refresh()
    assert info.output_bytes == 100_000  # kept output never exceeds the cap


async def test_stdin(sb: Sandbox) -> None:
    assert (await sb.run_shell("wc -c", stdin="x" * 100000)).stdout.strip() == "100000"
    proc = await sb.start("cat; echo end", stdin=True)
    await proc.write_stdin("one\n")
    await proc.write_stdin(b"two\n")
    await proc.close_stdin()
    r = await proc.collect()
    assert r.stdout == "one\ntwo\nend\n"
    sess = await sb.session()
    assert (await sess.run("read x; echo got $x", stdin="hi\n")).stdout == "got hi\n"


async def test_signals(sb: Sandbox) -> None:
    proc = await sb.start(
        "trap 'echo got INT; exit 7' INT; echo ready; while true; do sleep 0.05; done"
    )
    async for chunk in proc.output():
        assert chunk.data == b"ready\n"
        break
    await proc.interrupt()
    r = await proc.collect()
    assert r.exit_code == 7 and r.stdout == "ready\ngot INT\n"
    mark = marker()
    proc = await sb.start(f"sleep {mark}")
    await proc.terminate()
    assert (await proc.wait()).exit_code == 143
    proc = await sb.start(f"sleep {mark} & sleep {mark}")
    exit_info = await proc.kill()
    assert exit_info is not None and exit_info.exit_code == 137
    assert await gone(mark)
    with pytest.raises(InvalidArgument):
        await proc.send_signal("bogus")


async def test_commands_start_with_default_signal_dispositions(sb: Sandbox) -> None:
    """No signal ignored, caught or blocked in a command, whatever the agent does with
    them itself (dsec-init resets only the ones it changed, on every command's path).
    Signals 32 and 33 belong to the C library (sigaction refuses them), and a shell
    ignores SIGQUIT itself: an argv command, and those two left out."""
    r = await sb.exec(["grep", "-E", "^Sig(Ign|Cgt|Blk)", "/proc/self/status"])
    fields = {k: int(v, 16) for k, v in (line.split(":\t") for line in r.stdout.splitlines())}
    libc = (1 << 31) | (1 << 32)
    assert fields == {"SigBlk": 0, "SigIgn": fields["SigIgn"] & libc, "SigCgt": 0}, r.stdout


async def test_background_process_streams_later_from_another_client(
    platform: PlatformProcess, sb: Sandbox
) -> None:
    proc = await sb.start("for i in 1 2 3; do echo $i; sleep 0.05; done; echo bye >&2; exit 2")
    assert any(p.id == proc.id and p.state == "running" for p in await sb.processes())
    assert (await proc.wait()).exit_code == 2
    async with DSecClient(platform.url, platform.api_key) as other:
        again = await (await other.get(sb.id)).process(proc.id)
        r = await again.collect()
    assert (r.exit_code, r.stdout, r.stderr) == (2, "1\n2\n3\n", "bye\n")
    listed = {p.id: p for p in await sb.processes()}
    assert listed[proc.id].state == "exited" and listed[proc.id].exit is not None


# ---- terminal -----------------------------------------------------------------------


async def _read_until(ws: object, needle: bytes, timeout: float = 10.0) -> bytes:
    seen = b""
    async with asyncio.timeout(timeout):
        while needle not in seen:
            msg = await ws.recv()  # type: ignore[attr-defined]
            if isinstance(msg, bytes):
                seen += msg
    return seen


async def test_pty_over_a_real_websocket(sb: Sandbox) -> None:
    info = sb.info.data_path
    assert info is not None
    url = info.url.replace("http://", "ws://") + f"/v1/edge/sandboxes/{sb.id}/pty"
    async with connect(f"{url}?rows=20&cols=70&token={info.token}") as ws:
        await ws.send(b"stty size; tty\n")
        out = await _read_until(ws, b"/dev/pts/")
        assert b"20 70" in out
        await ws.send(json.dumps({"type": "resize", "rows": 33, "cols": 101}))
        await asyncio.sleep(0.1)
        await ws.send(b"stty size\n")
        assert b"33 101" in await _read_until(ws, b"33 101")
        await ws.send(b"sleep 100\n")
        await asyncio.sleep(0.2)
        await ws.send(b"\x03")  # Ctrl-C reaches the foreground job through the terminal
        await ws.send(b"echo after-$((1+1))\n")
        await _read_until(ws, b"after-2")
        await ws.send(b"exit 9\n")
        ended = None
        async with asyncio.timeout(10):
            async for msg in ws:
                if isinstance(msg, str):
                    ended = json.loads(msg)
        assert ended is not None and ended["type"] == "exit" and ended["exit_code"] == 9


def start_cli(argv: list[str], tty_fd: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The CLI with a real terminal as its stdin, stdout and stderr."""
    return subprocess.Popen(
        argv, stdin=tty_fd, stdout=tty_fd, stderr=tty_fd, env=env, start_new_session=True
    )


async def test_cli_shell_in_a_real_terminal(platform: PlatformProcess, sb: Sandbox) -> None:
    import pty as ptymod
    import sys

    main_fd, child_fd = ptymod.openpty()
    env = dict(os.environ, DSEC_URL=platform.url, DSEC_API_KEY=platform.api_key)
    argv = [sys.executable, "-m", "dsec.cli.main", "sandbox", "shell", sb.id]
    proc = start_cli(argv, child_fd, env)
    os.close(child_fd)
    try:
        loop = asyncio.get_running_loop()
        got = b""
        deadline = time.monotonic() + 20
        sent = False
        while b"cli-" + b"42" not in got and time.monotonic() < deadline:
            if not sent and b"#" in got:
                os.write(main_fd, b"echo cli-$((6*7)); exit 4\n")
                sent = True
            try:
                got += await asyncio.wait_for(loop.run_in_executor(None, os.read, main_fd, 4096), 5)
            except (OSError, TimeoutError):
                break
        assert b"cli-42" in got, got
        assert await loop.run_in_executor(None, proc.wait, 20) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)


# ---- lifecycle ----------------------------------------------------------------------


async def test_no_leaked_processes_after_stop(client: DSecClient, busybox_image: str) -> None:
    mark = marker()
    sandbox = await client.run_container(args(busybox_image))
    try:
        sess = await sandbox.session()
        bg = await sess.start(f"sleep {mark}")
        await sandbox.start(f"setsid sleep {mark} & sleep {mark}")
        pty = await sandbox.pty(command=f"sleep {mark}")
        stream = sandbox.stream(f"echo x; sleep {mark}")
        await anext(stream)
        assert len(host_processes_with(mark)) >= 4
    finally:
        await sandbox.stop()
    assert await gone(mark), f"processes outlived their sandbox: {host_processes_with(mark)}"
    with pytest.raises(SandboxNotRunning):
        await pty.read()
    with pytest.raises(SandboxNotRunning):
        await stream.wait()
    with pytest.raises((SandboxNotRunning, NotFound)):
        await bg.wait()
    with pytest.raises(SandboxNotRunning):
        await sandbox.session()


def test_sync_twins(platform: PlatformProcess, busybox_image: str) -> None:
    with DSecSyncClient(platform.url, platform.api_key) as client:
        sandbox = client.run_container(args(busybox_image))
        try:
            with sandbox.session() as sess:
                sess.run("cd /etc")
                assert sess.run("pwd").stdout == "/etc\n"
            chunks = list(sandbox.stream("echo a; echo b >&2"))
            assert [c.stream for c in chunks] == ["stdout", "stderr"]
            proc = sandbox.start("cat", stdin=True)
            proc.write_stdin("z")
            proc.close_stdin()
            assert proc.collect().stdout == "z"
            assert [p.id for p in sandbox.processes()] == [proc.id]
            sandbox.write_file("/tmp/t.txt", "text")
            assert sandbox.read_text("/tmp/t.txt") == "text"
            assert sandbox.stat("/tmp/t.txt").size == 4
            with sandbox.pty(command="echo pty-ok") as term:
                out = b""
                while data := term.read():
                    out += data
                assert b"pty-ok" in out and term.exit is not None
        finally:
            sandbox.stop()


async def test_ttl_counts_data_path_activity(client: DSecClient, busybox_image: str) -> None:
    sandbox = await client.run_container(args(busybox_image, ttl_running_stop=2))
    try:
        sess = await sandbox.session()
        for _ in range(6):
            await sess.run("true")
            await asyncio.sleep(0.5)
        assert (await sandbox.refresh()).state.value == "running"
    finally:
        await sandbox.stop()


async def test_bad_input_is_a_typed_4xx(sb: Sandbox) -> None:
    with pytest.raises(InvalidArgument):
        await sb.run_shell("")
    with pytest.raises(InvalidArgument):
        await sb.run_shell("true", timeout=-1)
    with pytest.raises(InvalidArgument):
        await sb.session(workdir="relative")
    with pytest.raises(NotFound):
        await sb.process("p0000000000000000")
    with pytest.raises(InvalidArgument, match="unknown op"):
        await sb._data.call(sb.id, "no-such-op", {})
    with pytest.raises(InvalidArgument):
        await sb._data.call(sb.id, "run", {"command": "true", "bogus": 1})
    with pytest.raises(InvalidArgument):
        await sb._data.call(sb.id, "signal", {"process": 5})
    # The connection survives bad requests.
    assert (await sb.run_shell("echo still")).stdout == "still\n"


async def test_file_path_is_relative_to_sandbox(sb: Sandbox) -> None:
    # `..` never climbs out of the sandbox's root: this is the sandbox's own passwd.
    inside = await sb.read_file("/tmp/../../../../etc/passwd")
    assert inside != HOST_PASSWD
    assert inside == (await sb.run_shell("cat /etc/passwd")).stdout_bytes


async def test_every_fast_command_is_on_record_once(
    client: DSecClient, sb: Sandbox, platform: PlatformProcess
) -> None:
    """The reply to a command goes out as soon as the agent reports its exit and the
    edge's bookkeeping (process_end, detectors) follows it: commands sent back to back,
    async and sync, still each have one process_start and one process_end with their
    exit code."""
    for i in range(20):
        assert (await sb.run_shell(f"exit {i % 3}")).exit_code == i % 3
    with DSecSyncClient(platform.url, platform.api_key) as sync:
        ssb = sync.get(sb.id)
        for i in range(10):
            assert ssb.run_shell(f"exit {i % 2}").exit_code == i % 2
    rows = await client.audit(sandbox=sb.id, kinds=[AuditKind.COMMAND])
    starts = {r.detail["process"]: r.detail["command"] for r in rows if r.action == "process_start"}
    ends = [r for r in rows if r.action == "process_end"]
    codes = sorted(r.detail["exit_code"] for r in ends)
    assert len(starts) == 30 and len(ends) == 30
    assert {r.detail["process"] for r in ends} == set(starts)
    assert codes == sorted([i % 3 for i in range(20)] + [i % 2 for i in range(10)])
