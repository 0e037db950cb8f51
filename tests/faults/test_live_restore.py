"""Item 1 of issue 13: live restore. Background processes belong to the agent inside the
sandbox (dsec-init, pid 1), not to the platform: their output is kept in a bounded ring
per process and their exit status is held until collected, so a platform that crashed
(SIGKILL) or restarted (SIGTERM) lists the same processes again, reads their output from
where a client left off and gets the exit status of those that ended meanwhile."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from dsec.agent import build
from dsec.errors import FileNotFound
from dsec.sessions.agent_client import ExecStream
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
        assert not k.running
        again = await agent.client.attach("big", 0)
        assert again.base == k.first > 0
        held = b"".join(d for _, d in await _collect(again))
        assert held.endswith(b"end\n") and len(held) <= 64 * KiB + 64 * KiB
        rss = vm_kib(agent.pid, "VmRSS")
        assert rss < 2048, f"agent RSS {rss} KiB"
