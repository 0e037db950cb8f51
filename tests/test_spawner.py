"""The per-host spawner (``dsec-init spawner``) through dsec.spawn: same results as the
posix_spawn path, children reaped, and it survives clients that misbehave or vanish."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import linux, spawn
from dsec.agent.build import agent_binary


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is ``pid``."""
    return [(child, st.state) for child, st in linux.proc_stats() if st.ppid == pid]


@pytest.fixture
async def spawner() -> AsyncIterator[spawn.HostSpawner]:
    with tempfile.TemporaryDirectory(prefix="dsec-sp-") as tmp:
        host = await spawn.start_spawner(agent_binary(), Path(tmp) / "run" / "spawner.sock")
        pid = host.pid
        assert pid is not None
        try:
            yield host
        finally:
            spawn.use_spawner(None)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # noqa: ASYNC222 - SIGKILLed: returns at once


async def test_results_match_posix_spawn(spawner: spawn.HostSpawner) -> None:
    script = "echo out; echo err >&2; ls /proc/self/fd; [ -e /proc/self/fd/7 ] && exit 3"
    r, w = os.pipe()
    try:
        results = []
        for path in (spawner.path, None):
            spawn.use_spawner(path)
            results.append(await spawn.run(["/bin/sh", "-c", script], pass_fd=(r, 7)))
            killed = await spawn.run(["/bin/sh", "-c", "kill -9 $$"])
            assert killed.returncode == -signal.SIGKILL
            with pytest.raises(FileNotFoundError):
                await spawn.run(["/nonexistent/binary"])
    finally:
        os.close(r)
        os.close(w)
    via, here = results
    assert via.returncode == 3 and via.stderr == "err\n"
    assert via.stdout.split() == ["out", "0", "1", "2", "3", "7"]  # nothing else leaks
    assert here.returncode == 3 and here.stdout.startswith("out\n")


async def test_crun_wrap_runs_in_the_spawners_child_like_a_spawned_one(
    spawner: spawn.HostSpawner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``crun-wrap`` request for the spawner's own binary runs crun_wrap() in a forked
    child instead of exec'ing the binary again: the command it execs must see the same
    as through posix_spawn (fds 0-2 and the passed one only, no blocked or ignored
    signal, the request's environment) and its failures must come back the same."""
    wrap = str(agent_binary())
    script = (
        'echo "$DSEC_T_MARK"; ls /proc/self/fd; '
        "grep -E '^Sig(Blk|Ign)' /proc/self/status; echo err >&2; exit 5"
    )
    monkeypatch.setenv("DSEC_T_MARK", "from-the-request")
    spawn.use_spawner(spawner.path)
    r, w = os.pipe()
    try:
        # The spawner's two ways: fork + crun_wrap() for its own binary; posix_spawn of
        # a copy of the binary at another path (what a platform with a newer agent sends).
        with tempfile.TemporaryDirectory(prefix="dsec-sp-copy-") as tmp:
            copy = Path(tmp) / "dsec-init-copy"
            await asyncio.to_thread(shutil.copy2, wrap, copy)
            results = [
                await spawn.run(
                    [binary, "crun-wrap", "--", "/bin/sh", "-c", script], pass_fd=(r, 3)
                )
                for binary in (wrap, str(copy))
            ]
        bad = await spawn.run([wrap, "crun-wrap", "--", "/nonexistent/crun"])
        usage = await spawn.run([wrap, "crun-wrap", "--overlay-target", "/x"])
    finally:
        os.close(r)
        os.close(w)
    forked, spawned = results
    assert forked.returncode == spawned.returncode == 5
    assert forked.stdout == spawned.stdout and forked.stderr == spawned.stderr == "err\n"
    lines = forked.stdout.split("\n")
    assert lines[0] == "from-the-request"
    assert lines[1:6] == ["0", "1", "2", "3", "4"]  # 4: ls's own directory fd
    assert "SigBlk:\t0000000000000000" in forked.stdout
    assert bad.returncode == 127 and "cannot execute /nonexistent/crun" in bad.stderr
    assert usage.returncode != 0 and "usage" in usage.stderr


SESSION_KEYRING = (
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, create=1)
    "print(libc.syscall(250, 0, -3, 1))"
)


async def test_each_container_start_gets_a_session_keyring_of_its_own(
    spawner: spawn.HostSpawner,
) -> None:
    """``crun-wrap --session-keyring new`` (what the platform passes when it starts a
    container, with crun's --no-new-keyring): every start joins a new anonymous session
    keyring, neither the caller's nor another container's."""
    spawn.use_spawner(spawner.path)
    wrap = str(agent_binary())
    # The caller's own session keyring (this test's, made if it had none).
    own = await spawn.run(["/bin/sh", "-c", f"exec /usr/bin/python3 -c '{SESSION_KEYRING}'"])
    argv = ["--", "/usr/bin/python3", "-c", SESSION_KEYRING]
    fresh = [await spawn.run([wrap, "crun-wrap", "--session-keyring", "new", *argv]) for _ in "ab"]
    bad = await spawn.run([wrap, "crun-wrap", "--session-keyring", "old", *argv])
    ids = [int(r.stdout) for r in (own, *fresh)]
    assert all(r.returncode == 0 for r in (own, *fresh)), (own, fresh)
    assert all(i > 0 for i in ids), ids
    assert len(set(ids)) == 3  # each start its own, not the caller's
    assert bad.returncode != 0 and "usage" in bad.stderr  # only "new" is understood


async def test_timeout_kills_and_everything_is_reaped(spawner: spawn.HostSpawner) -> None:
    assert spawner.pid is not None
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        # The backgrounded sleep is orphaned to the spawner (a subreaper) and reaped.
        await spawn.run(["/bin/sh", "-c", "sleep 0.2 & exec sleep 30"], timeout=0.3)
    assert time.monotonic() - t0 < 5
    # Cancelled right after the request went out, before the pid came back.
    task = asyncio.create_task(spawn.run(["/bin/sleep", "30"]))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if not _children(spawner.pid):
            break
        await asyncio.sleep(0.1)
    assert _children(spawner.pid) == []


async def test_survives_clients_that_vanish_or_send_garbage(spawner: spawn.HostSpawner) -> None:
    assert spawner.pid is not None
    path = str(spawner.path)
    for payload in (b"", b"garbage", b"\x01\x00\x00\x00" * 4 + b"x"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(path)
            if payload:
                s.send(payload)
                assert len(s.recv(8)) in (0, 8)
    # A client that disconnects while its child runs: the child runs on and is reaped.
    out = os.memfd_create("out")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(path)
            header = spawn._HEADER.pack(spawn._OP_RUN, -1, 2, 0)
            socket.send_fds(s, [header + b"/bin/sleep\x000.2\x00"], [out, out])
            assert len(s.recv(8)) == 8
    finally:
        os.close(out)
    await asyncio.sleep(0.5)
    assert _children(spawner.pid) == []
    assert (await spawn.run(["/bin/true"])).returncode == 0
    spawner.stop()
    assert spawner.pid is None and not spawner.path.exists()


async def test_reaping_under_many_children(spawner: spawn.HostSpawner) -> None:
    """Many long-lived adopted children (as every sandbox's init is) and deaths that
    arrive together (their SIGCHLDs merge): every exit status reaches its client, and
    every orphan is reaped, without a waitpid(-1) pass per death (dsec-init.c)."""
    assert spawner.pid is not None
    # 300 orphans that live on (like idle sandboxes' inits), adopted by the spawner.
    await spawn.run(["/bin/sh", "-c", "for i in $(seq 300); do (sleep 30 &); done"])
    assert sum(1 for _pid, st in _children(spawner.pid) if st != "Z") >= 300
    # 40 concurrent runs, each with its own status and a short-lived orphan that dies
    # at about the same time as its parent.
    results = await asyncio.gather(
        *(spawn.run(["/bin/sh", "-c", f"(sleep 0.1 &); exit {i}"]) for i in range(40))
    )
    assert [r.returncode for r in results] == list(range(40))
    # The short-lived orphans (0.1 s) may all still live now, and a check that finds no
    # zombie before they die proves nothing (it raced the assert below): wait them out.
    await asyncio.sleep(0.15)
    zombies: list[int] = []
    for _ in range(50):
        zombies = [pid for pid, st in _children(spawner.pid) if st == "Z"]
        if not zombies:
            break
        await asyncio.sleep(0.1)
    assert zombies == []
    for pid, _st in _children(spawner.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        if not _children(spawner.pid):
            break
        await asyncio.sleep(0.1)
    assert _children(spawner.pid) == []


async def test_status_of_reaped_orphans(spawner: spawn.HostSpawner) -> None:
    """The spawner keeps how its orphans ended (a sandbox's init is one): how the edge
    says why an init died without holding a pidfd per sandbox (dsec.edge.deaths)."""
    spawn.use_spawner(spawner.path)
    # The shell leaves an orphan that kills itself once the shell is gone.
    res = await spawn.run(["/bin/sh", "-c", "sh -c 'sleep 0.2; kill -9 $$' & echo $!"])
    orphan = int(res.stdout.split()[0])
    status = None
    for _ in range(100):
        status = await spawn.reaped_status(orphan)
        if status is not None:
            break
        await asyncio.sleep(0.02)
    assert status is not None and os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signal.SIGKILL
    assert await spawn.reaped_status(2**22 + 7) is None  # never one of ours


async def test_stop_if_idle_stops_only_a_spawner_with_nothing_to_reap(
    spawner: spawn.HostSpawner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its children are read through the socket's peer credentials; a detached child
    (an init that outlives the platform) keeps it, an unreadable answer keeps it, and
    with nothing left it is stopped."""
    spawn.use_spawner(spawner.path)
    assert spawn.spawner_children(spawner.path) == []
    # A child that runs on: the spawner, a subreaper, becomes its parent (as of an init).
    await spawn.run(["/bin/sh", "-c", "sleep 30 <&- >&- 2>&- & echo started"])
    kids = spawn.spawner_children(spawner.path)
    assert kids, "the background sleep is the spawner's (re-parented) child"
    assert not spawner.stop_if_idle()
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if spawn.spawner_children(spawner.path) == []:
            break
        await asyncio.sleep(0.02)
    monkeypatch.setattr(spawn, "spawner_children", lambda path: None)
    assert not spawner.stop_if_idle(), "unknown is not idle"
    monkeypatch.undo()
    assert spawner.stop_if_idle()
    assert not spawn.spawner_answers(spawner.path)


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` (Z: a zombie), None once it is gone (reaped)."""
    st = linux.proc_stat(pid)
    return None if st is None else st.state


async def test_a_stop_reaps_every_child_first_dead_dying_or_alive(
    spawner: spawn.HostSpawner,
) -> None:
    """The platform stops the spawner right after stopping its sandboxes: their inits
    are then dead with their SIGCHLDs merged (reaped only by the next sweep), or still
    dying. A spawner that exited then would hand each to pid 1, which here never reaps
    (ci: a zombie init after `dsec down --stop-sandboxes`). It reaps them all first."""
    assert spawner.pid is not None
    spawn.use_spawner(spawner.path)
    started = await spawn.run(
        ["/bin/sh", "-c", "for i in $(seq 40); do sleep 30 <&- >&- 2>&- & echo $!; done"]
    )
    killed = [int(p) for p in started.stdout.split()]
    late = await spawn.run(["/bin/sh", "-c", "sleep 1 <&- >&- 2>&- & echo $!"])
    living = int(late.stdout)
    for pid in killed:  # deaths together: their SIGCHLDs merge
        os.kill(pid, signal.SIGKILL)
    assert _state(living) not in (None, "Z"), "alive when the stop begins"
    await asyncio.to_thread(spawner.stop)
    assert spawner.pid is None and not spawner.path.exists()
    assert {pid: _state(pid) for pid in [*killed, living]} == dict.fromkeys([*killed, living]), (
        "each is reaped by the spawner, none left to pid 1"
    )


async def test_a_stop_waits_for_a_spawner_it_did_not_start_and_leaves_one_still_needed(
    spawner: spawn.HostSpawner,
) -> None:
    """A restarted platform re-uses its predecessor's spawner (not its child): its stop
    waits for that one to drain too. A child that outlives the wait keeps its reaping
    parent: the spawner is left running, never killed, and exits once it is reaped."""
    assert spawner.pid is not None
    spawn.use_spawner(spawner.path)
    late = int((await spawn.run(["/bin/sh", "-c", "sleep 1 <&- >&- 2>&- & echo $!"])).stdout)
    assert _state(late) not in (None, "Z"), "alive when the stop begins"
    await asyncio.to_thread(spawn.HostSpawner(spawner.path, None).stop)
    assert _state(late) is None, "the stop returned once the spawner had reaped it and gone"
    assert _state(spawner.pid) == "Z", "the spawner exited (our child: the fixture reaps it)"

    spawner = await spawn.start_spawner(agent_binary(), spawner.path)
    assert spawner.pid is not None
    kept = 0
    try:
        kept = int((await spawn.run(["/bin/sh", "-c", "sleep 30 <&- >&- 2>&- & echo $!"])).stdout)
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        idle.connect(str(spawner.path))  # a client that had not sent its request yet
        await asyncio.to_thread(spawner.stop, 0.3)
        idle.settimeout(1.0)
        assert idle.recv(8) == b"", "told at once that no answer comes, not at the exit"
        idle.close()
        assert spawner.pid is not None and _state(spawner.pid) not in (None, "Z")
        assert not spawner.path.exists(), "it takes no new work"
        assert _children(spawner.pid) == [(kept, "S")], "still the parent of what lives on"
        os.kill(kept, signal.SIGKILL)
        for _ in range(500):
            if _state(spawner.pid) == "Z":
                break
            await asyncio.sleep(0.02)
        assert _state(spawner.pid) == "Z" and _state(kept) is None
    finally:
        if kept:  # then the draining spawner reaps it and exits; killed only if it does not
            with contextlib.suppress(ProcessLookupError):
                os.kill(kept, signal.SIGKILL)
        for _ in range(250):
            if _state(spawner.pid) in (None, "Z"):
                break
            await asyncio.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.kill(spawner.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(spawner.pid, 0)  # noqa: ASYNC222 - exited or SIGKILLed


async def test_an_idle_stop_does_not_count_the_dead_it_has_yet_to_reap(
    spawner: spawn.HostSpawner,
) -> None:
    """Sandboxes that all ended just before a clean shutdown leave their inits dead but
    maybe not reaped yet (SIGCHLDs merged, the sweep not due): that is idle. Counting
    them kept the spawner running for good after `dsec demo`, with nothing to reap."""
    assert spawner.pid is not None
    spawn.use_spawner(spawner.path)
    started = await spawn.run(
        ["/bin/sh", "-c", "for i in $(seq 40); do sleep 30 <&- >&- 2>&- & echo $!; done"]
    )
    killed = [int(p) for p in started.stdout.split()]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):  # all dead: gone, or zombies the spawner has yet to reap
        if all(_state(pid) in (None, "Z") for pid in killed):
            break
        await asyncio.sleep(0.01)
    assert await asyncio.to_thread(spawner.stop_if_idle)
    assert spawner.pid is None and [_state(pid) for pid in killed] == [None] * len(killed)
