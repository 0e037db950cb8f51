"""Adversarial suite, class "pid 1 obeys signals from inside" (issue 12, item 4).

Root inside a sandbox tries to end its own episode before it is graded by signalling
pid 1, every way the kernel offers: each signal number, SIGKILL/SIGSTOP, a pid with
high bits the kernel drops, kill(-1), thread-directed calls, queued signals that claim
to come from the host, pidfd_send_signal on a pidfd and on a /proc/1 fd, F_SETOWN +
F_SETSIG (the kernel itself then signals pid 1, or its process group), a terminal, an
orphan in a new session, and a flood. After each: the sandbox still runs the same
pid 1 and answers, and a ``signal_to_init`` event names the attempt (refused by the
seccomp profile, or ignored and reported by pid 1). The host's own ways to stop,
pause and time out a sandbox still work.

Each test gets a fresh sandbox: events are rate-limited per sandbox, so attempts in
one sandbox would hide each other's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecClient, DSecContainerRunArgs, linux
from dsec.api.events import EventKind, SecurityEvent
from dsec.api.sandbox import SandboxState
from dsec.errors import DSecError
from dsec.sdk.client import Sandbox
from dsec.security.seccomp_listener import BURST
from tests.conftest import PlatformProcess
from tests.test_adversarial import ATTACK_IN_SANDBOX, attack_binary

pytestmark = pytest.mark.root

__all__ = ["attack_binary"]  # the fixture, re-exported for pytest


def _start_time(pid: int) -> int | None:
    """When ``pid`` started: tells a process from a later one with the same pid."""
    st = linux.proc_stat(pid)
    return None if st is None else st.start_time


def _state(pid: int) -> str:
    st = linux.proc_stat(pid)
    return "gone" if st is None else st.state


@dataclass
class Target:
    client: DSecClient
    sandbox: Sandbox
    job: str
    init_pid: int  # pid 1 of the sandbox, as the host sees it
    init_start: int | None

    async def attack(self, name: str, arg: str = "") -> str:
        res = await self.sandbox.exec([ATTACK_IN_SANDBOX, name, *([arg] if arg else [])])
        out = res.stdout + res.stderr
        assert res.exit_code == 0, f"{name} could not run: {out}"
        assert "pid1: alive" in out, out
        return out

    async def assert_unharmed(self) -> None:
        """The same pid 1 runs (not a new one) and the sandbox answers."""
        assert _start_time(self.init_pid) == self.init_start, "pid 1 of the sandbox changed"
        # D is a moment of I/O, not harm: right after a resume pid 1 pages its memory
        # back in from the swap its pause went to. Stopped (T, t) or dead (Z) is harm.
        state = _state(self.init_pid)
        for _ in range(100):
            if state != "D":
                break
            await asyncio.sleep(0.05)
            state = _state(self.init_pid)
        assert state in ("S", "R"), f"pid 1 is in state {state}"
        res = await self.sandbox.run_shell("echo answering")
        assert (res.exit_code, res.stdout) == (0, "answering\n")
        assert (await self.sandbox.refresh()).state == SandboxState.RUNNING

    async def events(self) -> list[SecurityEvent]:
        return list(await self.client.events(job=self.job, kinds=[EventKind.SIGNAL_TO_INIT]))

    async def expect(self, **match: object) -> dict[str, Any]:
        """A signal_to_init event whose detail has these values (detectors report
        within a second; the loop is a wait, not a timing assertion)."""
        for _ in range(60):
            for ev in await self.events():
                if all(ev.detail.get(k) == v for k, v in match.items()):
                    assert ev.sandbox_id == self.sandbox.id
                    return ev.detail
            await asyncio.sleep(0.05)
        seen = [ev.detail for ev in await self.events()]
        raise AssertionError(f"no signal_to_init event with {match}; seen: {seen}")


@pytest.fixture
async def target(
    client: DSecClient, busybox_image: str, platform: PlatformProcess, attack_binary: Path
) -> AsyncIterator[Target]:
    job = "sig-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64, job_id=job)
    sb = await client.run_container(spec)
    try:
        await sb.write_file(
            ATTACK_IN_SANDBOX, await asyncio.to_thread(attack_binary.read_bytes), mode=0o755
        )
        pid = int((platform.data_dir / "sandboxes" / sb.id / "init.pid").read_text())
        yield Target(client, sb, job, pid, _start_time(pid))
    finally:
        with contextlib.suppress(DSecError):
            await sb.stop()


# ---- calls whose target a seccomp filter can read: refused and recorded ---------------


async def test_every_signal_number_from_a_root_shell(target: Target) -> None:
    out = await target.attack("sig_every")
    assert "refused=62 sent=0" in out, out
    # The shell's own kill too, with a signal that would end an unprotected init.
    res = await target.sandbox.run_shell("kill -TERM 1; kill -INT 1; echo rc=$?")
    assert "rc=1" in res.stdout, res
    await target.assert_unharmed()
    ev = await target.expect(signal="SIGHUP", via="seccomp", target=1)
    assert ev["comm"] == "attack" and ev["pid"] > 1 and ev["result"] == "EPERM"
    # Rate-limited: a burst per call, the rest counted.
    assert len(await target.events()) <= 2 * BURST


async def test_sigkill_and_sigstop_at_pid1(target: Target) -> None:
    """The kernel drops these for a namespace's init anyway; the filter puts them on
    record (they never reach pid 1's signalfd)."""
    await target.attack("sig_kill_stop")
    await target.assert_unharmed()
    await target.expect(signal="SIGKILL", syscall="kill", target=1)
    await target.expect(signal="SIGSTOP", syscall="kill", target=1)


async def test_pid_with_high_bits_the_kernel_drops(target: Target) -> None:
    """kill(1 << 32 | 1): the kernel truncates the pid to 32 bits; a 64-bit compare in
    the filter would let it through."""
    await target.attack("sig_wide_pid")
    await target.assert_unharmed()
    ev = await target.expect(signal="SIGTERM", target=1)
    assert ev["args"][0] == hex((1 << 32) | 1)
    await target.expect(signal="SIGINT", target=1)


async def test_broadcast_kill(target: Target) -> None:
    """kill(-1) skips pid 1 by definition: the sandbox's own processes end (an honest
    cleanup idiom), pid 1 and the sandbox stay, and it is not an attack on pid 1."""
    bg = await target.sandbox.run_shell("sleep 300 >/dev/null 2>&1 & echo $!")
    await target.sandbox.run_shell("kill -9 -1; true")  # Linux spares the sender
    await target.assert_unharmed()
    res = await target.sandbox.run_shell(f"kill -0 {bg.stdout.strip()} 2>/dev/null || echo gone")
    assert res.stdout == "gone\n", res


async def test_thread_directed_signals(target: Target) -> None:
    await target.attack("sig_thread")
    await target.assert_unharmed()
    await target.expect(syscall="tgkill", signal="SIGTERM", target=1)
    await target.expect(syscall="tkill", signal="SIGINT", target=1)


async def test_queued_signal_that_claims_to_come_from_the_host(target: Target) -> None:
    await target.attack("sig_queue_forged")
    await target.assert_unharmed()
    await target.expect(syscall="rt_sigqueueinfo", signal="SIGTERM", target=1)
    await target.expect(syscall="rt_tgsigqueueinfo", signal="SIGINT", target=1)


async def test_orphan_in_a_new_session(target: Target) -> None:
    await target.attack("sig_new_session")
    await target.assert_unharmed()
    await target.expect(syscall="kill", signal="SIGTERM", target=1, comm="attack")
    await target.expect(syscall="kill", signal="SIGQUIT", target=1)


# ---- paths a filter cannot see: they reach pid 1, which ignores and reports them ------


async def test_pidfd_and_proc_fd_of_pid1(target: Target) -> None:
    out = await target.attack("sig_pidfd")
    assert "pidfd_send_signal(SIGTERM): sent" in out, out  # delivered, and ignored
    await target.assert_unharmed()
    ev = await target.expect(signal="SIGTERM", via="init", code="SI_USER", comm="attack")
    assert ev["pid"] > 1 and ev["action"] == "ignored"
    # si_pid 0 would mean "the host": forged through a queued code, and not believed.
    await target.expect(signal="SIGINT", via="init", code="SI_QUEUE", pid_claimed=0)
    await target.expect(signal="SIGHUP", via="init", code="SI_USER")  # the /proc/1 fd


async def test_kernel_sent_sigio_to_pid1_and_its_group(target: Target) -> None:
    """F_SETOWN + F_SETSIG: the kernel signals the fd's owner on I/O, so the sender is
    the kernel and the filter sees only a write()."""
    await target.attack("sig_async_io")
    await target.assert_unharmed()
    await target.expect(signal="SIGTERM", via="init", code="POLL_IN")
    await target.expect(signal="SIGINT", via="init", code="POLL_IN")  # process group 1


async def test_terminal_signals(target: Target) -> None:
    """pid 1 has no terminal and its process group is out of reach (another session);
    a terminal whose owner is pid 1 signals it on I/O, and that is ignored too."""
    out = await target.attack("sig_tty_hangup")
    assert "TIOCSPGRP to process group 1: refused" in out, out
    assert "setpgid(0, 1): refused" in out, out
    await target.assert_unharmed()
    await target.expect(signal="SIGHUP", via="init")
    vhangup = await target.client.events(job=target.job, kinds=[EventKind.SECCOMP_VIOLATION])
    assert any(ev.detail.get("syscall") == "vhangup" for ev in vhangup)


async def test_signal_flood(target: Target) -> None:
    """Queued real-time signals by the thousand: pid 1 drains them in bounded batches
    and keeps serving; the edge records a burst and counts the rest."""
    out = await target.attack("sig_flood", "4000")
    assert "sent 4000 of 4000" in out, out
    await target.assert_unharmed()
    await target.expect(signo=int(signal.SIGRTMIN), via="init", code="SI_USER")
    assert len(await target.events()) <= BURST + 1
    # Still recording after the flood (the count of what was left out rides along).
    await asyncio.sleep(0)
    res = await target.sandbox.run_shell("sleep 0.01; echo done")
    assert res.stdout == "done\n"


# ---- what must keep working -----------------------------------------------------------


async def test_honest_signal_use_raises_nothing(target: Target) -> None:
    """kill -0 1 (a liveness probe), signals among the sandbox's own processes, a
    process group of its own, timeouts: no event, and everything behaves as usual."""
    res = await target.sandbox.run_shell(
        "kill -0 1 && echo probe-ok; sleep 30 & p=$!; kill -TERM $p; wait $p; echo rc=$?; "
        "sh -c 'trap \"echo got-usr1\" USR1; kill -USR1 $$; true'; "
        "trap '' TERM; sh -c 'kill -TERM 0; echo group-done'"
    )
    assert "probe-ok" in res.stdout and "rc=143" in res.stdout, res
    assert "got-usr1" in res.stdout and "group-done" in res.stdout, res
    timed = await target.sandbox.exec(["sleep", "30"], timeout=0.5)
    assert timed.timed_out and timed.exit_code == 137
    await target.assert_unharmed()
    await asyncio.sleep(0.3)  # give a wrong event the time to arrive
    assert await target.events() == []


async def test_host_can_still_pause_time_out_and_stop(target: Target) -> None:
    await target.attack("sig_every")
    report = await target.client.pause_job(target.job)
    assert report.paused == 1
    resumed = await target.client.resume_job(target.job)
    assert resumed.job_id == target.job
    await target.assert_unharmed()
    timed = await target.sandbox.exec(["sleep", "30"], timeout=0.5)
    assert timed.timed_out
    info = await target.sandbox.stop()
    assert info.state == SandboxState.STOPPED
    # pid 1 is gone: reaped (another process or none under its pid), or dead and not
    # reaped yet (its reaper sweeps merged SIGCHLDs every 200 ms)
    st = linux.proc_stat(target.init_pid)
    assert st is None or st.dead or st.start_time != target.init_start


async def test_sigterm_from_the_host_still_ends_it(target: Target) -> None:
    """A signal from outside the pid namespace (an operator's `crun kill`) is obeyed:
    the kernel reports its sender as pid 0, which nothing inside can claim for SI_USER."""
    os.kill(target.init_pid, signal.SIGTERM)
    for _ in range(200):  # wait for pid 1 to exit (a zombie until its parent reaps it)
        st = linux.proc_stat(target.init_pid)
        if st is None or st.start_time != target.init_start or st.dead:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("pid 1 did not obey SIGTERM from the host")
    assert await target.events() == []  # the host's signal is no attempt
