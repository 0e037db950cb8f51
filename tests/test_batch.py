"""Batch creation (/v1/batches): end to end against a real `dsec up`, plus the runner's
stop-on-quota and concurrency limit, which need failures a single node cannot produce
on demand (a quota) and are exercised with stand-ins for the create path only."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient, SandboxState
from dsec.api.batch import (
    BATCH_LABEL,
    INDEX_LABEL,
    BatchAccepted,
    BatchCreated,
    BatchDone,
    BatchEvent,
    BatchFailed,
    BatchStatus,
    CreateBatchRequest,
)
from dsec.api.sandbox import SandboxInfo
from dsec.api.spec import RunArgs
from dsec.apiserver.creator import SandboxCreator
from dsec.control.batch import BatchRunner
from dsec.errors import (
    AdmissionRejected,
    BatchNotFound,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    QuotaExceeded,
)
from dsec.sdk import Sandbox, SyncSandbox
from tests.conftest import PlatformProcess, platform_process
from tests.test_apiserver_unit import FakeEdge, FakeImages


def spec(image: str, **kw: object) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 64)
    return DSecContainerRunArgs.model_validate({"container_image": image, **kw})


async def stop_batch_sandboxes(client: DSecClient, batch_id: str) -> None:
    """Leave nothing behind, whatever the test saw."""
    live = await client.list_sandboxes(labels={BATCH_LABEL: batch_id})
    await asyncio.gather(*(sb.stop() for sb in live))


def check_partition(done: BatchDone, count: int, created: set[int], failed: set[int]) -> None:
    assert done.created == len(created) and done.failed == len(failed)
    assert not created & failed
    assert done.created + done.failed + done.cancelled == count


# ---- end to end ------------------------------------------------------------------------


@pytest.mark.root
async def test_batch_creates_tags_and_streams(client: DSecClient, busybox_image: str) -> None:
    count, job = 30, "rl-batch-e2e"
    batch = await client.create_batch(spec(busybox_image), count=count, job=job)
    assert batch.id is not None
    try:
        events: list[BatchEvent] = [e async for e in batch]
        assert isinstance(events[0], BatchAccepted) and events[0].count == count
        assert isinstance(events[-1], BatchDone)
        done = events[-1]
        assert (done.created, done.failed, done.cancelled) == (count, 0, 0), done
        created = [e for e in events if isinstance(e, BatchCreated)]
        assert sorted(e.index for e in created) == list(range(count))
        for ev in created:
            sb = ev.sandbox
            assert sb.state is SandboxState.RUNNING
            assert sb.spec.job_id == job
            assert sb.labels[BATCH_LABEL] == batch.id
            assert sb.labels[INDEX_LABEL] == str(ev.index)
            assert sb.data_path is not None  # as usable as a create answer
        listed = await client.list_sandboxes(labels={BATCH_LABEL: batch.id})
        assert {s.id for s in listed} == {e.sandbox.id for e in created}
        handles = batch.sandboxes
        assert len(handles) == count and all(isinstance(h, Sandbox) for h in handles)
        res = await batch.sandbox(7).exec(["cat", "/proc/1/comm"])
        assert res.exit_code == 0
        status = await client.get_batch(batch.id)
        assert status.state == "done" and status.created == count and status.pending == 0
    finally:
        await stop_batch_sandboxes(client, batch.id)
    assert not await client.list_sandboxes(labels={BATCH_LABEL: batch.id})


@pytest.mark.root
async def test_cancel_mid_batch_reports_everything(client: DSecClient, busybox_image: str) -> None:
    count = 60
    batch = await client.create_batch(
        spec(busybox_image), count=count, job="rl-cancel", parallelism=2
    )
    assert batch.id is not None
    try:
        seen_created = 0
        async for event in batch:
            if isinstance(event, BatchCreated):
                seen_created += 1
                if seen_created == 3:
                    status = await batch.cancel()
                    assert status.state in ("cancelling", "done")
        done = batch.done
        assert done is not None and done.cancelled > 0, done
        check_partition(done, count, set(batch.created), set(batch.failures))
        assert done.reason is not None and "cancelled" in done.reason
        # Nothing leaked: exactly the sandboxes reported created exist.
        live = await client.list_sandboxes(labels={BATCH_LABEL: batch.id})
        assert {s.id for s in live} == {i.id for i in batch.created.values()}
        assert (await batch.cancel()).state == "done"  # idempotent
    finally:
        await stop_batch_sandboxes(client, batch.id)


@pytest.mark.root
async def test_cancel_can_stop_what_was_created(client: DSecClient, busybox_image: str) -> None:
    batch = await client.create_batch(
        spec(busybox_image), count=20, job="rl-abandon", parallelism=2
    )
    assert batch.id is not None
    try:
        async for event in batch:
            if isinstance(event, BatchCreated):
                await batch.cancel(stop_created=True)
                break
        done = await batch.wait()
        assert done.stopped == done.created >= 1
        assert not await client.list_sandboxes(labels={BATCH_LABEL: batch.id})
    finally:
        await stop_batch_sandboxes(client, batch.id)


@pytest.mark.root
async def test_client_disconnect_cancels_the_rest(
    client: DSecClient, platform: PlatformProcess, busybox_image: str
) -> None:
    body = CreateBatchRequest(
        spec=spec(busybox_image), count=60, job="rl-disconnect", parallelism=2
    ).model_dump_json()
    headers = {"Authorization": f"Bearer {platform.api_key}", "Content-Type": "application/json"}
    batch_id = ""
    try:
        async with (
            httpx.AsyncClient(base_url=platform.url, timeout=30) as http,
            http.stream("POST", "/v1/batches", content=body, headers=headers) as resp,
        ):
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            lines = resp.aiter_lines()
            first = json.loads(await anext(lines))
            assert first["event"] == "accepted"
            batch_id = first["batch_id"]
            async for line in lines:
                if json.loads(line)["event"] == "created":
                    break  # leave with the stream open: the client goes away
        status: BatchStatus | None = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = await client.get_batch(batch_id)
            if status.state == "done":
                break
            await asyncio.sleep(0.05)
        assert status is not None and status.state == "done", status
        assert status.cancelled > 0 and status.reason == "client disconnected", status
        assert status.created + status.failed + status.cancelled == 60
        # The created ones stay: they belong to the job.
        live = await client.list_sandboxes(labels={BATCH_LABEL: batch_id})
        assert len(live) == status.created
    finally:
        if batch_id:
            await stop_batch_sandboxes(client, batch_id)


@pytest.mark.root
async def test_bad_requests_are_typed_422_and_unknown_batch_404(
    client: DSecClient, platform: PlatformProcess, busybox_image: str
) -> None:
    args = spec(busybox_image)
    for kwargs in (
        {"count": 0, "job": "j"},
        {"count": 32_001, "job": "j"},
        {"count": 2, "job": "bad/job"},
        {"count": 2, "job": "j", "parallelism": 0},
    ):
        with pytest.raises(InvalidArgument):  # checked in the SDK first
            await client.create_batch(args, **kwargs)  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {platform.api_key}"}
    async with httpx.AsyncClient(base_url=platform.url, timeout=30) as http:
        for body in (
            {"spec": args.model_dump(mode="json"), "count": 32_001, "job": "j"},
            {"spec": args.model_dump(mode="json"), "count": 1, "job": "bad/job"},
            {"spec": args.model_dump(mode="json"), "count": 1},
            {"spec": {**args.model_dump(mode="json"), "job_id": "other"}, "count": 1, "job": "j"},
        ):
            r = await http.post("/v1/batches", json=body, headers=headers)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "invalid_argument"
        r = await http.post("/v1/batches", json={"count": 1, "job": "j"})
        assert r.status_code == 401
    for call in (client.get_batch("b-0000000000000000"), client.cancel_batch("b-nope")):
        with pytest.raises(BatchNotFound):
            await call
    # A missing image fails every index with the same typed error (not a 500).
    batch = await client.create_batch(spec("no-such-image:1"), count=3, job="j")
    done = await batch.wait()
    assert done.failed == 3 and {e.code for e in batch.failures.values()} == {"image_not_found"}


@pytest.mark.root
def test_sync_twin(platform: PlatformProcess, busybox_image: str) -> None:
    with DSecSyncClient(platform.url, platform.api_key) as client:
        batch = client.create_batch(spec(busybox_image), count=4, job="rl-sync")
        assert batch.id is not None
        try:
            kinds = [e.event for e in batch]
            assert kinds[0] == "accepted" and kinds[-1] == "done"
            assert kinds.count("created") == 4
            assert batch.done is not None and batch.done.created == 4
            handles = batch.sandboxes
            assert all(isinstance(h, SyncSandbox) for h in handles)
            assert handles[0].exec(["true"]).exit_code == 0
            assert client.get_batch(batch.id).state == "done"
        finally:
            for sb in client.list_sandboxes(labels={BATCH_LABEL: batch.id}):
                sb.stop()
            batch.close()


@pytest.mark.root
def test_cli_batch(platform: PlatformProcess, busybox_image: str) -> None:
    base = [sys.executable, "-m", "dsec.cli.main", "--url", platform.url]
    base += ["--api-key", platform.api_key, "sandbox", "batch", busybox_image]
    run = subprocess.run(
        [*base, "--count", "3", "--job", "rl-cli", "--memory", "64", "--stop-after", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert (report["created"], report["failed"], report["stopped"]) == (3, 0, 3)
    with DSecSyncClient(platform.url, platform.api_key) as client:
        assert not client.list_sandboxes(labels={BATCH_LABEL: report["batch_id"]})
    # Human output: a summary with failures grouped by code, exit status 1.
    run = subprocess.run(
        [*base[:-1], "no-such-image:1", "--count", "2", "--job", "rl-cli"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "0 created, 2 failed, 0 cancelled" in run.stdout
    assert "image_not_found: 2 (indexes 0, 1)" in run.stdout


@pytest.mark.root
async def test_partial_failure_is_reported_per_index(busybox_image: str) -> None:
    """A host that admits 4 sandboxes: of 8, exactly 4 are created and each of the
    other 4 fails with the edge's typed AdmissionRejected (real admission, no mock)."""
    with platform_process(DSEC_MAX_SANDBOXES="4") as plat:
        async with DSecClient(plat.url, plat.api_key) as client:
            await client.build_image("busybox")
            batch = await client.create_batch(
                spec(busybox_image), count=8, job="rl-partial", parallelism=2
            )
            assert batch.id is not None
            try:
                failed: list[BatchFailed] = [e async for e in batch if isinstance(e, BatchFailed)]
                done = batch.done
                assert done is not None
                assert (done.created, done.failed, done.cancelled) == (4, 4, 0), done
                check_partition(done, 8, set(batch.created), set(batch.failures))
                assert set(batch.created) | set(batch.failures) == set(range(8))
                assert {e.error.code for e in failed} == {AdmissionRejected.code}
                assert all(isinstance(e.error.exception(), AdmissionRejected) for e in failed)
                status = await client.get_batch(batch.id)
                assert status.failures_by_code == {AdmissionRejected.code: 4}
            finally:
                await stop_batch_sandboxes(client, batch.id)


@pytest.mark.root
async def test_shutdown_cancels_running_batches(busybox_image: str) -> None:
    """SIGTERM mid-batch: the apiserver does not wait for 2,000 creates before exiting;
    the stream ends with `done` and the platform stops what was created."""
    with platform_process() as plat:
        assert plat.proc is not None
        async with DSecClient(plat.url, plat.api_key) as client:
            await client.build_image("busybox")
            batch = await client.create_batch(
                spec(busybox_image), count=2000, job="rl-shutdown", parallelism=2
            )
            async for event in batch:
                if isinstance(event, BatchCreated):
                    t0 = time.monotonic()
                    plat.proc.send_signal(signal.SIGTERM)
                    break
            done = await batch.wait()
            assert done.reason == "apiserver shutting down" and done.cancelled > 1900, done
            check_partition(done, 2000, set(batch.created), set(batch.failures))
        plat.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 20


# ---- the runner: stop-on-quota and limits ----------------------------------------------


class QuotaCreator(SandboxCreator):
    """Stand-in for the quota charge (dsec.control.quotas) on the create path: the
    first ``allowed`` creates pass, then every create is over quota."""

    def __init__(self, edge: FakeEdge, allowed: int) -> None:
        super().__init__(edge)
        self.allowed = allowed
        self.attempts = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def create(self, principal: str, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        self.attempts += 1
        await self.gate.wait()
        if self.attempts > self.allowed:
            raise QuotaExceeded(
                "project rl is over its sandboxes quota", project="rl", limit=self.allowed
            )
        return await super().create(principal, spec, timeout=timeout)


@pytest.fixture
async def fake_creator() -> AsyncIterator[QuotaCreator]:
    yield QuotaCreator(FakeEdge(FakeImages()), allowed=5)


async def test_quota_stops_the_batch_fast(fake_creator: QuotaCreator) -> None:
    runner = BatchRunner(fake_creator)
    req = CreateBatchRequest(spec=spec("busybox"), count=1000, job="j", parallelism=4)
    batch = runner.start("alice", req)
    events = [e for chunk in [c async for c in batch.events()] for e in chunk]
    done = events[-1]
    assert isinstance(done, BatchDone)
    assert done.created == 5 and done.failed == 995 and done.cancelled == 0
    assert fake_creator.attempts <= 5 + 4  # at most one in-flight wave over quota
    failed = [e for e in events if isinstance(e, BatchFailed)]
    assert {e.error.code for e in failed} == {"quota_exceeded"}
    assert sum(1 for e in failed if e.error.details.get("attempted") is False) >= 995 - 4
    assert done.reason is not None and done.reason.startswith("stopped early: quota_exceeded")


async def test_batches_per_apiserver_are_limited(fake_creator: QuotaCreator) -> None:
    fake_creator.allowed = 10_000
    fake_creator.gate.clear()  # creates wait: both batches stay running
    runner = BatchRunner(fake_creator, max_batches=2)
    req = CreateBatchRequest(spec=spec("busybox"), count=10, job="j", parallelism=2)
    first = runner.start("alice", req)
    runner.start("bob", req)
    with pytest.raises(LimitExceeded, match="already runs 2 batches"):
        runner.start("carol", req)
    with pytest.raises(BatchNotFound):
        runner.get("b-unknown", "alice")
    with pytest.raises(PermissionDenied, match="another principal"):
        runner.get(first.id, "bob")
    for _ in range(500):  # until both batches have their creates in flight
        if fake_creator.attempts >= 4:
            break
        await asyncio.sleep(0.01)
    status = runner.cancel(first.id, "alice")
    assert status.state == "cancelling" and status.in_flight == 2
    fake_creator.gate.set()
    done = await first.wait()
    assert (done.created, done.cancelled) == (2, 8)
    await runner.close()
    assert not runner.running()
