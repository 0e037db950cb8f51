"""Durability: SIGKILL the platform while sandboxes run or are being created, start it
again on the same data directory, and check what survives and that nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.errors import AdmissionRejected, DSecError
from tests.conftest import pid1_orphans, platform_process, spawners

pytestmark = pytest.mark.root


async def _client(url: str, key: str) -> DSecClient:
    c = DSecClient(url, key)
    await c.open()
    return c


async def test_sigkill_then_restart_readopts_running_and_cleans_half_created() -> None:
    # Container inits and crun processes must keep a reaping parent (the spawner)
    # across the crash: pid 1 here never reaps, so a leak would stay a zombie forever.
    orphans_before = pid1_orphans()
    with platform_process() as plat:
        client = await _client(plat.url, plat.api_key)
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=128)
            keep = await client.run_container(spec)
            await keep.run_shell("echo state-before-crash > /root/state")
            # Start a burst of creates and kill the platform while they are in flight.
            burst = [asyncio.create_task(client.run_container(spec)) for _ in range(12)]
            await asyncio.sleep(0.05)
            spawner = spawners(plat.data_dir)
            assert len(spawner) == 1
            plat.kill()
            for task in burst:
                with contextlib.suppress(DSecError, Exception):
                    await task
        finally:
            await client.close()

        assert spawners(plat.data_dir) == spawner, "the spawner must outlive the platform"
        plat.start()
        assert spawners(plat.data_dir) == spawner, "a restarted platform re-uses it"
        lost = pid1_orphans(edge_id=plat.edge_id) - orphans_before
        assert not lost, "an init or crun lost its reaping parent"
        client = await _client(plat.url, plat.api_key)
        try:
            again = await client.get(keep.id)
            assert again.info.state is SandboxState.RUNNING
            r = await again.run_shell("cat /root/state")
            assert r.stdout == "state-before-crash\n"
            for sb in await client.list_sandboxes(
                states=[SandboxState.RUNNING, SandboxState.CREATING, SandboxState.STOPPING]
            ):
                # Whatever was still creating is failed now; everything listed live runs.
                assert sb.info.state is SandboxState.RUNNING
                assert (await sb.run_shell("echo ok")).stdout == "ok\n"
            await keep.stop()
        finally:
            await client.close()
        plat.stop()
        # Clean shutdown stops the spawner (the leak check asserts that too).
        assert spawners(plat.data_dir) == []
    for _ in range(50):  # the last reap may still be in flight
        zombies = pid1_orphans(zombies_only=True, edge_id=plat.edge_id) - orphans_before
        if not zombies:
            break
        await asyncio.sleep(0.1)
    assert not zombies, "an init or crun is a zombie"


async def test_admission_rejects_when_host_full() -> None:
    with platform_process(DSEC_MAX_SANDBOXES="2") as plat:
        client = await _client(plat.url, plat.api_key)
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
            a = await client.run_container(spec)
            b = await client.run_container(spec)
            with pytest.raises(AdmissionRejected, match="full"):
                await client.run_container(spec)
            await a.stop()
            c = await client.run_container(spec)
            await asyncio.gather(b.stop(), c.stop())
        finally:
            await client.close()


async def test_a_clean_shutdown_keeps_the_spawner_only_while_sandboxes_run_on() -> None:
    """`dsec up`'s default: sandboxes run on across a clean shutdown, and so does their
    reaping parent. With none left running (all stopped, or none made, as after `dsec
    demo` on the default data dir) nothing is left behind: the spawner ends too."""
    with platform_process(DSEC_STOP_SANDBOXES_ON_EXIT="0") as plat:
        client = await _client(plat.url, plat.api_key)
        try:
            await client.build_image("busybox")
            spec = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
            keep = await client.run_container(spec)
            gone = await client.run_container(spec)
            await gone.stop()
        finally:
            await client.close()
        plat.stop()
        assert len(spawners(plat.data_dir)) == 1, "a sandbox runs on: its parent stays"
        plat.start()
        client = await _client(plat.url, plat.api_key)
        try:
            again = await client.get(keep.id)
            assert (await again.run_shell("echo on")).stdout == "on\n"
            await again.stop()
        finally:
            await client.close()
        plat.stop()
        assert spawners(plat.data_dir) == [], "nothing runs on: the spawner ended too"
