"""Item 1 of issue 13: live restore. Background processes belong to the agent inside the
sandbox (dsec-init, pid 1), not to the platform: their output is kept in a bounded ring
per process and their exit status is held until collected, so a platform that crashed
(SIGKILL) or restarted (SIGTERM) lists the same processes again, reads their output from
where a client left off and gets the exit status of those that ended meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, linux
from dsec.agent import build
from dsec.api.events import AuditKind
from dsec.api.exec import ProcessInfo
from dsec.errors import DSecError, FileNotFound
from dsec.sdk.datapath import Process
from dsec.sessions.agent_client import ExecStream
from tests.conftest import PlatformProcess, pid1_orphans, platform_process
from tests.test_agent import running_agent, vm_kib

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent switches users: needs root"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the agent"),
]

KiB = 1 << 10


@pytest.fixture(scope="module")
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


# --------------------------------------------------------------------------------------
# the agent alone: kept commands outlive their client


async def _collect(stream: ExecStream) -> list[tuple[int, bytes]]:
    return [chunk async for chunk in stream.chunks()]


@pytest.mark.parametrize("pid_namespace", [False, True])
async def test_agent_keeps_command_after_client_is_gone(
    agent_bin: Path, pid_namespace: bool
) -> None:
    with running_agent(agent_bin, pid_namespace=pid_namespace) as agent:
        script = "i=0; while [ $i -lt 30 ]; do echo line$i; i=$((i+1)); sleep 0.02; done; exit 7"
        stream = await agent.client.start(
            ["/bin/sh", "-c", script],
            env={},
            cwd="",
            user="root",
            timeout=None,
            max_output=1 << 20,
            with_stdin=False,
            keep=("p1", '{"command": "counter"}', 64 * KiB),
        )
        first = await stream.next_chunk()
        assert first is not None
        await stream.aclose()  # the "platform" is gone: the command runs on
        kept = await agent.client.kept()
        assert [k.key for k in kept] == ["p1"]
        assert kept[0].meta == '{"command": "counter"}'
        assert kept[0].running and kept[0].pid == stream.pid
        again = await agent.client.attach("p1", 1)
        assert again.base == 1
        rest = await _collect(again)
        assert again.status is not None and again.status.exit_code == 7
        text = (first[1] + b"".join(d for _, d in rest)).decode()
        assert text == "".join(f"line{i}\n" for i in range(30))
        # Finished, and still held until forgotten: a new attach replays it all.
        (done,) = await agent.client.kept()
        assert not done.running and done.status is not None and done.status.exit_code == 7
        assert done.delivered  # a client saw it end
        full = await agent.client.attach("p1", 0)
        assert full.base == 0
        assert b"".join(d for _, d in await _collect(full)).decode() == text
        assert await agent.client.forget("p1")
        assert await agent.client.kept() == []
        with pytest.raises(FileNotFound):
            await agent.client.attach("p1", 0)


async def test_agent_ring_is_bounded(agent_bin: Path) -> None:
    with running_agent(agent_bin, pid_namespace=False) as agent:
        stream = await agent.client.start(
            ["/bin/sh", "-c", "head -c 4000000 /dev/zero; echo end"],
            env={},
            cwd="",
            user="root",
            timeout=None,
            max_output=64 << 20,
            with_stdin=False,
            keep=("big", "", 64 * KiB),
        )
        await stream.aclose()
        for _ in range(200):
            (k,) = await agent.client.kept()
            if not k.running:
                break
            await asyncio.sleep(0.02)
        assert not k.running and not k.delivered  # it ended with nobody attached
        again = await agent.client.attach("big", 0)
        assert again.base == k.first > 0
        held = b"".join(d for _, d in await _collect(again))
        assert held.endswith(b"end\n") and len(held) <= 64 * KiB + 64 * KiB
        rss = vm_kib(agent.pid, "VmRSS")
        assert rss < 2048, f"agent RSS {rss} KiB"


# --------------------------------------------------------------------------------------
# the platform: SIGKILL and SIGTERM mid-burst with background processes running

COUNT = 400  # lines per counter: ~15 s, so every counter straddles the restart
SANDBOXES = 2
COUNTERS = 3  # per sandbox (and BURST more started while the platform goes down)
BURST = 4


def counter(k: int) -> str:
    """Writes COUNT numbered lines to stdout and to /root/c<k>, then exits with k."""
    return (
        f"i=0; while [ $i -lt {COUNT} ]; do echo c{k}-$i; echo $i >> /root/c{k}; "
        f"i=$((i+1)); sleep 0.03; done; exit {k}"
    )


def expected(k: int) -> str:
    return "".join(f"c{k}-{i}\n" for i in range(COUNT))


def host_sleeps(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        st = linux.proc_stat(int(entry))
        if st is not None and not st.dead and cmdline == b"sleep\0" + mark.encode() + b"\0":
            found.append(int(entry))
    return found


def down(plat: PlatformProcess, *, stop_sandboxes: bool) -> None:
    """`dsec down` (the operator's way to stop a platform) and reap it."""
    argv = [sys.executable, "-m", "dsec.cli.main", "down", "--data-dir", str(plat.data_dir)]
    if stop_sandboxes:
        argv.append("--stop-sandboxes")
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    assert plat.proc is not None
    plat.proc.wait(10)
    plat.proc = None


async def _text(proc: Process, start: int = 0) -> str:
    return "".join([chunk.text async for chunk in proc.output(start=start)])


@pytest.mark.root
@pytest.mark.parametrize("how", ["sigkill", "sigterm", "dsec-down"])
async def test_background_processes_survive_platform_restart(how: str) -> None:
    orphans_before = pid1_orphans()
    mark = str(600000 + secrets.randbelow(99999))
    figures: dict[str, float] = {"processes_injected": 0, "survived": 0, "lost": 0}
    with platform_process(DSEC_STOP_SANDBOXES_ON_EXIT="0") as plat:
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        counters: dict[str, tuple[str, int]] = {}  # process id -> (sandbox id, k)
        shorts: dict[str, str] = {}  # process id -> sandbox id
        sleepers: dict[str, str] = {}
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=128)
            sandboxes = [await client.run_container(spec) for _ in range(SANDBOXES)]
            for sb in sandboxes:
                for k in range(COUNTERS):
                    counters[(await sb.start(counter(k))).id] = (sb.id, k)
                shorts[(await sb.start("sleep 0.5; echo short; exit 3")).id] = sb.id
                sleepers[(await sb.start(f"sleep {mark}")).id] = sb.id
            # A session with state, and a background command of it.
            sess = await sandboxes[0].session()
            await sess.run("cd /tmp && export LIVE=restored")
            sess_bg = (await sess.start(counter(9))).id
            counters[sess_bg] = (sandboxes[0].id, 9)
            # A client reads the first chunks of one counter before the crash...
            first_id = next(iter(counters))
            first = await sandboxes[0].process(first_id)
            seen: list[str] = []
            async for chunk in first.output():
                seen.append(chunk.text)
                if len(seen) == 5:
                    break
            # ...and more processes are being started while the platform goes down.
            burst = [
                asyncio.create_task(sandboxes[i % SANDBOXES].start(counter(COUNTERS + i)))
                for i in range(BURST)
            ]
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            if how == "sigkill":
                plat.kill()
            elif how == "sigterm":
                plat.stop()
            else:  # the operator's command: SIGTERM, and wait until the platform is gone
                await asyncio.to_thread(down, plat, stop_sandboxes=False)
            shutdown_s = time.monotonic() - t0
            for i, task in enumerate(burst):
                with contextlib.suppress(DSecError, Exception):
                    counters[(await task).id] = (sandboxes[i % SANDBOXES].id, COUNTERS + i)
        finally:
            await client.close()
        figures["shutdown_s"] = round(shutdown_s, 2)
        if how != "sigkill":
            assert shutdown_s < 10, f"SIGTERM took {shutdown_s:.1f}s"
        assert len(host_sleeps(mark)) == SANDBOXES, "the sandboxes' processes run on"
        await asyncio.sleep(1.0)  # the short ones end while no platform is there
        figures["processes_injected"] = len(counters) + len(shorts) + len(sleepers)

        plat.start()
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            listed: dict[str, ProcessInfo] = {}
            for sid in {sid for sid, _ in counters.values()}:
                sb = await client.get(sid)
                listed.update({p.id: p for p in await sb.processes()})
            for pid_ in [*counters, *shorts, *sleepers]:
                figures["survived" if pid_ in listed else "lost"] += 1
            assert figures["lost"] == 0, f"not listed after the restart: {figures}"
            running = [i for i in counters if listed[i].state == "running"]
            assert running, "no counter was still running: the test proves nothing"
            figures["running_across_restart"] = len(running)
            for pid_, sid in shorts.items():
                assert listed[pid_].state == "exited", listed[pid_]
                proc = await (await client.get(sid)).process(pid_)
                assert (await proc.wait()).exit_code == 3
                assert await _text(proc) == "short\n"
            for pid_, (sid, k) in counters.items():
                sb = await client.get(sid)
                proc = await sb.process(pid_)
                assert (await proc.wait()).exit_code == k
                assert await _text(proc) == expected(k), f"output of counter {k}"
                r = await sb.run_shell(f"cat /root/c{k}")
                assert r.stdout == "".join(f"{i}\n" for i in range(COUNT))
            # The client that read 5 chunks before the crash goes on from its offset.
            sid0, k0 = counters[first_id]
            again = await (await client.get(sid0)).process(first_id)
            assert "".join(seen) + await _text(again, start=5) == expected(k0)
            for pid_ in sleepers:
                assert listed[pid_].state == "running"
            # The session is there again, with its state, and its process is listed.
            sb0 = await client.get(sandboxes[0].id)
            assert listed[sess_bg].session == sess.id
            resumed = await sb0.get_session(sess.id)
            r = await resumed.run("pwd; echo $LIVE")
            assert r.stdout == "/tmp\nrestored\n"
            figures["sessions_resumed"] = 1
            # Every end is on record exactly once, also of those that ended while down.
            ended = [*shorts, *counters]
            for _ in range(100):
                rows = [
                    r
                    for sid in {sid for sid, _ in counters.values()}
                    for r in await client.audit(sandbox=sid, kinds=[AuditKind.COMMAND])
                    if r.action == "process_end"
                ]
                ends = [r.detail.get("process") for r in rows]
                if all(ends.count(i) >= 1 for i in ended):
                    break
                await asyncio.sleep(0.05)
            assert {i: ends.count(i) for i in ended} == dict.fromkeys(ended, 1)
        finally:
            await client.close()
        down(plat, stop_sandboxes=True)  # the explicit way to end them all
        assert not host_sleeps(mark), "stopped sandboxes leave no process behind"
    zombies = pid1_orphans(zombies_only=True, edge_id=plat.edge_id) - orphans_before
    assert not zombies, "an init or crun is a zombie"
    print(f"\nlive restore after {how}: {figures}")


async def test_agent_rings_share_a_bounded_budget(agent_bin: Path) -> None:
    """64 kept commands printing 1.5 MB each (rings of 1 MiB asked): the agent holds
    each one's newest share of 8 MiB, never 64 MiB, and every tail is still there."""
    with running_agent(agent_bin, pid_namespace=False) as agent:
        before = vm_kib(agent.pid, "VmRSS")
        n = 64
        for i in range(n):
            stream = await agent.client.start(
                ["/bin/sh", "-c", f"head -c 1500000 /dev/zero; echo end{i}"],
                env={},
                cwd="",
                user="root",
                timeout=None,
                max_output=64 << 20,
                with_stdin=False,
                keep=(f"k{i}", "", 1 << 20),
            )
            await stream.aclose()
        for _ in range(500):
            kept = await agent.client.kept()
            if len(kept) == n and not any(k.running for k in kept):
                break
            await asyncio.sleep(0.02)
        assert len(kept) == n and not any(k.running for k in kept)
        grown = vm_kib(agent.pid, "VmRSS") - before
        print(f"\nagent RSS grew by {grown} KiB for {n} kept commands of 1.5 MB output")
        assert grown < 20 * 1024, f"the agent grew by {grown} KiB for {n} rings"
        for i in range(n):
            held = b"".join(d for _, d in await _collect(await agent.client.attach(f"k{i}")))
            assert held.endswith(f"end{i}\n".encode())
            assert len(held) <= (8 << 20) // n + 2 * 65536, len(held)


@pytest.mark.root
async def test_paused_sandbox_processes_come_back_when_it_resumes() -> None:
    """A sandbox paused (frozen) across the crash: its agent cannot answer at start, so
    its processes are re-attached when it runs again (resume_job or any request)."""
    job = "live" + secrets.token_hex(3)
    with platform_process() as plat:
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=128, job_id=job
            )
            sb = await client.run_container(spec)
            proc = await sb.start("i=0; while [ $i -lt 100 ]; do echo $i; i=$((i+1)); done")
            assert (await proc.wait()).exit_code == 0
            bg = await sb.start(counter(1))
            await client.pause_job(job)
            plat.kill()
        finally:
            await client.close()
        plat.start()
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            await client.resume_job(job)
            sb = await client.get(sb.id)
            for _ in range(100):
                ids = {p.id for p in await sb.processes()}
                if {proc.id, bg.id} <= ids:
                    break
                await asyncio.sleep(0.05)
            assert {proc.id, bg.id} <= ids
            again = await sb.process(bg.id)
            assert (await again.wait()).exit_code == 1
            assert await _text(again) == expected(1)
            done = await sb.process(proc.id)
            assert await _text(done) == "".join(f"{i}\n" for i in range(100))
            await sb.stop()
        finally:
            await client.close()
