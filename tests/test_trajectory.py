"""Trajectory log and replay (DSEC.md §6.2), end to end on a real `dsec up`.

Every command here runs in a real crun sandbox; a side-effect counter file in the
sandbox (one line per real execution) proves what ran and what was answered from the
log.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient
from dsec.errors import (
    Conflict,
    InvalidArgument,
    SandboxNotRunning,
    TrajectoryStateLost,
    TrajectoryStepInDoubt,
)
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

COUNTER = "/tmp/counter"
REPO = Path(__file__).resolve().parent.parent


def spec(image: str, **kw: object) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 128)
    return DSecContainerRunArgs.model_validate({"container_image": image, **kw})


def bump(i: int) -> str:
    """A non-idempotent step: appends to the counter and answers its new length."""
    return f"echo {i} >> {COUNTER} && wc -l < {COUNTER}"


async def counter(sb: Sandbox) -> list[str]:
    res = await sb.run_shell(f"cat {COUNTER} 2>/dev/null || true")
    return res.stdout.split()


async def test_fast_forward_then_continue(client: DSecClient, busybox_image: str) -> None:
    async with await client.run_container(spec(busybox_image)) as sb:
        traj = client.trajectory("job-ff", "r0")
        first = [await traj.run_shell(sb, bump(i)) for i in range(5)]
        await traj.write_file(sb, "/tmp/notes.txt", "hello")
        assert [r.stdout.strip() for r in first] == ["1", "2", "3", "4", "5"]
        assert traj.executed == 6 and traj.replayed == 0

        again = client.trajectory("job-ff", "r0")  # a resumed trainer: steps from 0
        second = [await again.run_shell(sb, bump(i)) for i in range(5)]
        await again.write_file(sb, "/tmp/notes.txt", "hello")
        assert [r.stdout for r in second] == [r.stdout for r in first]
        assert again.replayed == 6 and again.executed == 0 and again.last_replayed
        assert await counter(sb) == ["0", "1", "2", "3", "4"]  # nothing ran twice

        res = await again.run_shell(sb, bump(5))  # beyond the log: runs for real
        assert res.stdout.strip() == "6" and not again.last_replayed
        assert await counter(sb) == ["0", "1", "2", "3", "4", "5"]

        info = await again.info()
        assert info.steps == 7 and info.sandboxes == [sb.id] and info.discarded == 0
        recs = await again.records()
        assert [r.step for r in recs] == list(range(7))
        assert recs[0].replays == 1 and recs[6].replays == 0
        assert recs[5].op == "write_file" and recs[5].request["file"]["size"] == 5

        # The plain calls take a trajectory too (the same log, the next step).
        res = await sb.run_shell(bump(6), trajectory=again)
        assert res.stdout.strip() == "7" and again.step == 8
        await sb.write_file("/tmp/n2", "x", trajectory=again)
        assert (await again.info()).steps == 9
        assert (await sb.read_file("/tmp/n2")) == b"x"

        # A step number past the end of the log is a caller's bug, not a new step.
        with pytest.raises(InvalidArgument, match="skips ahead"):
            await client.trajectory("job-ff", "r0", start_step=12).run_shell(sb, "true")


def test_sync_twin_logs_and_replays(platform: PlatformProcess, busybox_image: str) -> None:
    with DSecSyncClient(platform.url, platform.api_key) as client:
        sb = client.run_container(spec(busybox_image))
        try:
            traj = client.trajectory("job-sync", "r0")
            first = [traj.run_shell(sb, bump(i)).stdout for i in range(3)]
            sb.write_file("/tmp/s", "x", trajectory=traj)
            assert traj.executed == 4 and traj.step == 4
            again = client.trajectory("job-sync", "r0")
            assert [again.run_shell(sb, bump(i)).stdout for i in range(3)] == first
            assert again.replayed == 3 and again.last_replayed
            assert sb.run_shell(f"wc -l < {COUNTER}").stdout.strip() == "3"
            assert [r.step for r in again.records()] == [0, 1, 2, 3]
        finally:
            sb.stop()


async def test_divergence_discards_the_rest(client: DSecClient, busybox_image: str) -> None:
    async with await client.run_container(spec(busybox_image)) as sb:
        traj = client.trajectory("job-div", "r0")
        for i in range(6):
            await traj.run_shell(sb, bump(i))
        resumed = client.trajectory("job-div", "r0")
        await resumed.run_shell(sb, bump(0))
        await resumed.run_shell(sb, bump(1))
        res = await resumed.run_shell(sb, bump(100))  # differs at step 2: runs for real
        assert not resumed.last_replayed and res.stdout.strip() == "7"
        assert (resumed.replayed, resumed.executed) == (2, 1)
        info = await resumed.info()
        assert info.steps == 3 and info.discarded == 4
        recs = await resumed.records()
        assert [r.request["command"]["command"] for r in recs] == [bump(0), bump(1), bump(100)]
        # Step 3 of the old log is gone: sending it again runs it (it was never seen).
        await resumed.run_shell(sb, bump(3))
        assert not resumed.last_replayed
        assert await counter(sb) == ["0", "1", "2", "3", "4", "5", "100", "3"]
        # The same content at another step number is a different step.
        await client.trajectory("job-div", "r0").run_shell(sb, bump(1))
        assert (await resumed.info()).steps == 1


async def test_concurrent_trajectories(client: DSecClient, busybox_image: str) -> None:
    boxes = await asyncio.gather(*(client.run_container(spec(busybox_image)) for _ in range(3)))
    try:

        async def rollout(k: int, sb: Sandbox) -> list[str]:
            traj = client.trajectory("job-conc", f"r{k}")
            return [(await traj.run_shell(sb, bump(i))).stdout.strip() for i in range(8)]

        outs = await asyncio.gather(*(rollout(k, sb) for k, sb in enumerate(boxes)))
        assert outs == [[str(i + 1) for i in range(8)]] * 3
        again = await asyncio.gather(*(rollout(k, sb) for k, sb in enumerate(boxes)))
        assert again == outs
        for sb in boxes:
            assert len(await counter(sb)) == 8
        infos = await client.trajectories("job-conc")
        assert [(i.rollout_id, i.steps) for i in infos] == [("r0", 8), ("r1", 8), ("r2", 8)]
        # A trajectory is bound to its sandboxes: another rollout may not use r0's.
        with pytest.raises(Conflict, match="bound to trajectory job-conc/r0"):
            await client.trajectory("job-conc", "r9").run_shell(boxes[0], "true")
        # Concurrent steps of one trajectory are serialised, never interleaved.
        traj = client.trajectory("job-conc", "r0", start_step=8)
        steps = [{"sandbox_id": boxes[0].id, "command": {"command": bump(i)}} for i in range(8, 12)]
        await traj.send(steps)
        assert len(await counter(boxes[0])) == 12
    finally:
        await asyncio.gather(*(sb.stop() for sb in boxes))


async def test_spec_binding_and_plain_calls(
    client: DSecClient, platform: PlatformProcess, busybox_image: str
) -> None:
    async with await client.run_container(
        spec(busybox_image, job_id="job-plain", trajectory_id="r1")
    ) as sb:
        with pytest.raises(Conflict, match="belongs to job-plain/r1"):
            await client.trajectory("job-plain", "r2").run_shell(sb, "true")
        headers = {"Authorization": f"Bearer {platform.api_key}"}
        async with httpx.AsyncClient(base_url=platform.url, headers=headers) as http:
            # ExecRequest.trajectory on the plain exec route, and query params on the
            # plain file write: the same log.
            ref = {"job_id": "job-plain", "rollout_id": "r1", "step": 0}
            body = {"command": bump(0), "trajectory": ref}
            url = f"/v1/sandboxes/{sb.id}/exec"
            a = (await http.post(url, json=body)).json()
            b = (await http.post(url, json=body)).json()
            assert a == b and a["stdout"].strip() == "1"
            params: dict[str, str | int] = {
                "path": "/tmp/x",
                "job_id": "job-plain",
                "rollout_id": "r1",
                "step": 1,
            }
            r = await http.put(f"/v1/sandboxes/{sb.id}/files", params=params, content=b"x")
            assert r.status_code == 204
            r = await http.put(
                f"/v1/sandboxes/{sb.id}/files", params={"path": "/tmp/y", "step": 2}, content=b""
            )
            assert r.status_code == 422 and "together" in r.json()["error"]["message"]
            r = await http.post(
                "/v1/trajectories/job-plain/r1/steps",
                json={"steps": [{"step": 2, "sandbox_id": sb.id}]},
            )
            assert r.status_code == 422 and "exactly one" in r.json()["error"]["message"]
        assert await counter(sb) == ["0"]
        recs = await client.trajectory_steps("job-plain", "r1")
        assert [(r.op, r.status) for r in recs] == [("exec", "ok"), ("write_file", "ok")]
        # Session input is a step too.
        session = await sb.session()
        traj = client.trajectory("job-plain", "r1", start_step=2)
        await traj.session_run(session, "cd /tmp && export X=7")
        res = await traj.session_run(session, "echo $X $(pwd)")
        assert res.stdout.strip() == "7 /tmp"
        again = client.trajectory("job-plain", "r1", start_step=2)
        await again.session_run(session, "cd /tmp && export X=7")
        assert (await again.session_run(session, "echo $X $(pwd)")).stdout == res.stdout
        assert again.replayed == 2


async def test_lost_sandbox_is_a_typed_error(client: DSecClient, busybox_image: str) -> None:
    sb = await client.run_container(spec(busybox_image))
    traj = client.trajectory("job-lost", "r0")
    for i in range(3):
        await traj.run_shell(sb, bump(i))
    await sb.stop()
    resumed = client.trajectory("job-lost", "r0")
    for i in range(3):  # what the log holds is still answered
        await resumed.run_shell(sb, bump(i))
    assert resumed.replayed == 3
    with pytest.raises(TrajectoryStateLost, match="is stopped") as info:
        await resumed.run_shell(sb, bump(3))
    assert info.value.status == 410 and info.value.details["sandbox_id"] == sb.id
    # A divergent step needs the sandbox too.
    with pytest.raises(TrajectoryStateLost):
        await client.trajectory("job-lost", "r0").run_shell(sb, "rm -rf /")
    # A trajectory that never used the sandbox gets the ordinary error.
    with pytest.raises(SandboxNotRunning):
        await client.trajectory("job-lost", "other").run_shell(sb, "true")


ROLLOUT_STEPS = 40


async def rollout(url: str, key: str, sandbox_id: str, report: bool) -> list[str]:
    """The trainer's rollout: counter steps, with a file write every 10th step."""
    outs: list[str] = []
    async with DSecClient(url, key) as client:
        sb = await client.get(sandbox_id)
        traj = client.trajectory("job-pre", "r0")
        for i in range(ROLLOUT_STEPS):
            if i % 10 == 9:
                await traj.write_file(sb, f"/tmp/file{i}", f"content {i}")
                outs.append("file")
            else:
                res = await traj.run_shell(sb, bump(i) + " && sleep 0.02")
                outs.append(res.stdout.strip())
            if report:
                print(f"step {i}", flush=True)
    return outs


def _child_main() -> None:
    url, key, sid = sys.argv[1:4]
    asyncio.run(rollout(url, key, sid, report=True))


async def test_preempted_trainer_resumes_from_the_log(
    client: DSecClient, platform: PlatformProcess, busybox_image: str
) -> None:
    async with await client.run_container(spec(busybox_image)) as sb:
        code = "import sys; from tests.test_trajectory import _child_main; _child_main()"
        child = subprocess.Popen(  # noqa: ASYNC220 - runs alongside, read in a thread
            [sys.executable, "-c", code, platform.url, platform.api_key, sb.id],
            stdout=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert child.stdout is not None
            seen = 0
            deadline = time.monotonic() + 60
            while seen < 15 and time.monotonic() < deadline:
                line = await asyncio.to_thread(child.stdout.readline)
                if not line:
                    break
                seen = int(line.split()[1]) + 1
            assert seen >= 15, "the rollout did not get far enough"
        finally:
            child.send_signal(signal.SIGKILL)  # preempted mid-rollout, mid-step
            child.wait()
        await asyncio.sleep(0.3)  # a step in flight when the trainer died still finishes
        done = (await client.trajectory("job-pre", "r0").info()).steps
        assert done >= seen

        outs = await rollout(platform.url, platform.api_key, sb.id, report=False)
        counted = [str(i) for i in range(ROLLOUT_STEPS) if i % 10 != 9]
        assert await counter(sb) == counted  # every command ran exactly once
        expected, n = [], 0
        for i in range(ROLLOUT_STEPS):
            if i % 10 == 9:
                expected.append("file")
            else:
                n += 1
                expected.append(str(n))
        assert outs == expected  # replayed answers are the original ones
        for i in range(9, ROLLOUT_STEPS, 10):
            assert (await sb.read_file(f"/tmp/file{i}")) == f"content {i}".encode()
        recs = await client.trajectory_steps("job-pre", "r0")
        assert len(recs) == ROLLOUT_STEPS and all(r.status == "ok" for r in recs)
        assert sum(1 for r in recs if r.replays == 1) == done


def test_log_survives_a_platform_restart() -> None:
    """The log is durable across a crash of the platform (SIGKILL); a step that was
    running at that moment is in doubt: neither replayed nor re-run."""
    with platform_process() as plat:
        with DSecSyncClient(plat.url, plat.api_key) as sync:
            sync.build_image("busybox")

        async def first() -> str:
            async with DSecClient(plat.url, plat.api_key) as client:
                sb = await client.run_container(
                    DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
                )
                traj = client.trajectory("job-rst", "r0")
                for i in range(4):
                    await traj.run_shell(sb, bump(i))
                slow = asyncio.create_task(traj.run_shell(sb, "sleep 3 && " + bump(4)))
                for _ in range(200):
                    recs = await client.trajectory_steps("job-rst", "r0")
                    if len(recs) == 5:
                        break
                    await asyncio.sleep(0.02)
                assert recs[4].status == "pending"
                plat.kill()  # a crash mid-step: the log holds the request, not the result
                with pytest.raises(Exception):  # noqa: B017 - the connection just dies
                    await slow
                return sb.id

        sid = asyncio.run(first())
        plat.start()

        async def second() -> None:
            async with DSecClient(plat.url, plat.api_key) as client:
                traj = client.trajectory("job-rst", "r0")
                outs = [(await traj.run_shell(sid, bump(i))).stdout.strip() for i in range(4)]
                assert outs == ["1", "2", "3", "4"] and traj.replayed == 4
                with pytest.raises(TrajectoryStepInDoubt, match="discard it") as info:
                    await traj.run_shell(sid, "sleep 3 && " + bump(4))
                assert info.value.status == 409

        asyncio.run(second())
        env = {**os.environ, "DSEC_URL": plat.url, "DSEC_API_KEY": plat.api_key, "COLUMNS": "250"}
        cli = [sys.executable, "-m", "dsec.cli.main", "trajectory"]
        shown = subprocess.run(
            [*cli, "show", "job-rst", "r0"], env=env, capture_output=True, text=True, check=True
        )
        assert "echo 3 >> /tmp/counter" in shown.stdout and "pending" in shown.stdout
        exported = subprocess.run(
            [*cli, "export", "job-rst"], env=env, capture_output=True, text=True, check=True
        )
        lines = [json.loads(line) for line in exported.stdout.splitlines()]
        assert [(r["step"], r["status"]) for r in lines] == [(i, "ok") for i in range(4)] + [
            (4, "pending")
        ]
        assert all(r["replays"] == 1 for r in lines[:4])
        assert lines[2]["result"]["stdout"] == "3\n"
        subprocess.run([*cli, "discard", "job-rst", "r0", "--from-step", "4"], env=env, check=True)

        async def third() -> None:
            async with DSecClient(plat.url, plat.api_key) as client:
                traj = client.trajectory("job-rst", "r0", start_step=4)
                sb = await client.get(sid)
                if sb.state.value == "running":  # re-adopted after the crash: it goes on
                    await traj.run_shell(sb, "echo after >> /tmp/counter")
                    assert (await counter(sb))[:4] == ["0", "1", "2", "3"]
                    await sb.stop()
                with pytest.raises(TrajectoryStateLost, match=r"is (stopped|failed)"):
                    await traj.run_shell(sid, bump(5))
            with DSecSyncClient(plat.url, plat.api_key) as sync:
                assert [i.steps for i in sync.trajectories("job-rst")] in ([4], [5])

        asyncio.run(third())
