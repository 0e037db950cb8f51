"""Cluster mode for real: PostgreSQL, apiservers, a watcher and edges in their own
network namespaces (tests/cluster_env.py), driven through the public SDK."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient
from dsec.api.cluster import EdgeStatus
from dsec.api.sandbox import SandboxInfo as SandboxInfoT
from dsec.api.sandbox import SandboxState
from dsec.cluster.remote import RemoteEdge
from dsec.cluster.router import view_of
from dsec.control.placement import Demand, EdgeLoad, Placer
from dsec.errors import EdgeUnavailable, PermissionDenied, QuotaExceeded, SandboxNotRunning
from tests.cluster_env import Cluster, cluster
from tests.faults.test_streams import MiB, hash_body, memory_cgroup, payload, payload_sha
from tests.pg import PostgresServer

pytestmark = pytest.mark.timeout(600)


def spec(**extra: object) -> DSecContainerRunArgs:
    base: dict[str, object] = {"container_image": "busybox:latest", "memory_limit_mb": 64}
    base.update(extra)
    return DSecContainerRunArgs.model_validate(base)


def build_busybox(c: Cluster) -> None:
    for edge in c.edges.values():
        with DSecSyncClient(edge.url, c.token) as client:
            client.build_image("busybox")


@pytest.fixture(scope="module")
def three_edges(postgres: PostgresServer) -> Iterator[Cluster]:
    with cluster(postgres, apiservers=2) as c:
        for i, cap in enumerate((300, 200, 150)):
            c.add_edge(i, capacity=cap)
        build_busybox(c)
        c.wait_edges_up(3)
        time.sleep(1.2)  # one more beat each: the images are in the view
        yield c


async def test_create_exec_stop_through_any_apiserver(three_edges: Cluster) -> None:
    c = three_edges
    async with (
        DSecClient(c.api_urls[0], c.admin_key) as a,
        DSecClient(c.api_urls[1], c.admin_key) as b,
    ):
        sb = await a.run_container(spec(labels={"t": "basic"}))
        assert sb.id.split("-")[0] in c.edges
        other = await b.get(sb.id)
        assert other.info.state is SandboxState.RUNNING
        result = await other.run_shell("echo hi from $(hostname)")
        assert result.stdout.startswith("hi from")
        listed = await b.list_sandboxes(labels={"t": "basic"})
        assert [s.id for s in listed] == [sb.id]
        assert sb.id in {r.id for r in await b.stats()}  # merged from the edges
        assert [r.id for r in await b.stats(sb.id)] == [sb.id]  # only that one
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = await http.get(
                f"{c.api_urls[0]}/metrics", headers={"Authorization": f"Bearer {c.admin_key}"}
            )
        assert metrics.status_code == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.text)
            for s in family.samples
        }
        placed = (("backend", "container"), ("outcome", "ok"))
        assert samples[("dsec_sandbox_creates_total", placed)] >= 1
        assert samples[("dsec_cluster_edges", (("status", "up"),))] == 3
        await other.stop()
        assert (await a.get(sb.id)).info.state is SandboxState.STOPPED


async def test_edge_answers_carry_its_usage_to_placement(three_edges: Cluster) -> None:
    """Another apiserver's create on an edge reaches this apiserver's placement view
    with the edge's next answer (LOAD_HEADER), not only with its next heartbeat: a
    real edge, and an apiserver's RemoteEdge and Placer (as dsec.cluster.router uses
    them); two RemoteEdges stand for two apiservers."""
    c = three_edges
    headers = {"Authorization": f"Bearer {c.admin_key}"}
    async with httpx.AsyncClient(headers=headers) as http:
        resp = await http.get(f"{c.api_urls[0]}/v1/cluster/edges")
    statuses = [EdgeStatus.model_validate(s) for s in resp.json()]
    status = max(statuses, key=lambda s: s.report.capacity)
    view = view_of(status, time.time())
    eid, cap, mem = view.edge_id, view.capacity, view.memory_mb
    assert view.seq > 0 and view.up  # heartbeats carry the usage version
    placer = Placer(k=5)
    placer.update([view])
    ours = RemoteEdge(eid, view.url, c.token)
    theirs = RemoteEdge(eid, view.url, c.token)
    d = Demand.for_spec(spec(), "container")
    made: list[str] = []

    def load_of(load: EdgeLoad) -> float:
        return max(load.sandboxes / cap, load.memory_committed_mb / mem)

    try:
        info, other = await theirs.create_load(spec(labels={"t": "piggy"}), timeout=60)
        made.append(info.id)
        assert other is not None and other.seq > view.seq
        placer.reserve(eid, d)
        info, load = await ours.create_load(spec(labels={"t": "piggy"}), timeout=60)
        made.append(info.id)
        assert load is not None and load.seq > other.seq and load.sandboxes >= 2
        placer.confirm(eid, d, load)
        # the other's create is counted, our own once: the newest answer's figures
        assert placer.reserved(eid) == 0
        assert placer.load(eid) == pytest.approx(load_of(load))
        # the heartbeat view from before both does not bring the old figures back
        placer.update([view_of(status, time.time())])
        assert placer.load(eid) == pytest.approx(load_of(load))
        info, gone = await ours.stop_load(made.pop(), reason="test")
        assert gone is not None and gone.seq > load.seq
        placer.released(eid, d, gone)
        assert placer.load(eid) == pytest.approx(load_of(gone))
        # a heartbeat taken after the stop takes over (newer by sequence)
        deadline = time.monotonic() + 60
        while True:
            async with httpx.AsyncClient(headers=headers) as http:
                resp = await http.get(f"{c.api_urls[0]}/v1/cluster/edges")
            fresh = next(EdgeStatus.model_validate(s) for s in resp.json() if s["edge_id"] == eid)
            if fresh.report.load_seq >= gone.seq or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert fresh.report.load_seq >= gone.seq
        placer.update([view_of(fresh, time.time())])
        r = fresh.report
        assert placer.load(eid) == pytest.approx(
            max(r.sandboxes / cap, r.memory_committed_mb / mem)
        )
    finally:
        for sid in made:
            with contextlib.suppress(EdgeUnavailable):
                await theirs.stop(sid)
        await ours.close()
        await theirs.close()


async def _burst(
    c: Cluster, count: int, *, label: str, parallelism: int = 24
) -> tuple[list[str], list[Exception]]:
    """``count`` creates spread over every apiserver; returns (ids, failures)."""
    clients = [DSecClient(url, c.admin_key, timeout=300) for url in c.api_urls]
    gate = asyncio.Semaphore(parallelism)
    ids: list[str] = []
    failures: list[Exception] = []

    async def one(i: int) -> None:
        async with gate:
            try:
                sb = await clients[i % len(clients)].run_container(
                    spec(labels={"burst": label}, ttl_running_stop=None)
                )
                ids.append(sb.id)
            except Exception as exc:  # collected and asserted on by the caller
                failures.append(exc)

    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        for client in clients:
            await client.close()
    return ids, failures


async def _stop_all(c: Cluster, ids: list[str]) -> None:
    """Clean-up: a sandbox on an edge that is not there is left to the leak check and
    clean-up of the cluster fixture, so that this never hides why a test failed."""
    async with DSecClient(c.api_urls[0], c.admin_key, timeout=300) as client:
        gate = asyncio.Semaphore(32)

        async def stop(sid: str) -> None:
            async with gate:
                with contextlib.suppress(EdgeUnavailable):
                    await client.stop_sandbox(sid)

        await asyncio.gather(*(stop(sid) for sid in ids))


async def test_burst_of_600_spread_by_capacity(three_edges: Cluster) -> None:
    c = three_edges
    start = time.perf_counter()
    ids, failures = await _burst(c, 600, label="b600")
    elapsed = time.perf_counter() - start
    try:
        assert not failures, f"{len(failures)} creates failed, e.g. {failures[:3]}"
        assert len(set(ids)) == 600
        per_edge = Counter(sid.split("-")[0] for sid in ids)
        capacity = {
            e.edge_id: cap for e, cap in zip(c.edges.values(), (300, 200, 150), strict=True)
        }
        for edge_id, n in per_edge.items():
            assert n <= capacity[edge_id]
        fill = [per_edge[e] / capacity[e] for e in capacity]
        # Spread by capacity: every edge about as full as the others (600/650 = 92%).
        assert max(fill) - min(fill) < 0.25, (per_edge, fill)
        print(f"600 sandboxes in {elapsed:.1f} s over 2 apiservers: {dict(per_edge)}")
    finally:
        await _stop_all(c, ids)


async def _wait_state(
    client: DSecClient, sid: str, state: SandboxState, timeout: float = 30.0
) -> SandboxInfoT:
    deadline = time.monotonic() + timeout
    while True:
        info = (await client.get(sid)).info
        if info.state is state or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.2)


async def test_edge_killed_mid_burst(three_edges: Cluster) -> None:
    """Its sandboxes become lost with a reason, the burst completes on the others, and
    when the edge comes back the survivors are re-adopted."""
    c = three_edges
    victim = c.edges[next(iter(c.edges))]
    burst = asyncio.create_task(_burst(c, 150, label="kill", parallelism=12))
    async with DSecClient(c.api_urls[1], c.admin_key, timeout=120) as client:
        deadline = time.monotonic() + 60
        on_victim: list[str] = []
        while len(on_victim) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            listed = await client.list_sandboxes(labels={"burst": "kill"})
            on_victim = [s.id for s in listed if s.id.startswith(victim.edge_id + "-")]
        assert on_victim, "no sandbox reached the victim edge"
        victim.proc.kill()
        ids, failures = await burst
        try:
            assert not failures, f"{len(failures)} creates failed, e.g. {failures[:3]}"
            assert len(ids) == 150
            # Creates in flight when it died were retried elsewhere: only the ones
            # answered from the victim are the cluster's, and they are lost.
            on_victim = [sid for sid in ids if sid.startswith(victim.edge_id + "-")]
            assert on_victim
            lost = await _wait_state(client, on_victim[0], SandboxState.LOST)
            assert lost.state is SandboxState.LOST, lost
            assert lost.reason and victim.edge_id in lost.reason, lost.reason
            listed = await client.list_sandboxes(states=[SandboxState.LOST])
            assert set(on_victim) <= {s.id for s in listed}
            with pytest.raises(SandboxNotRunning):
                await (await client.get(on_victim[0])).run_shell("true")

            c.start_edge(victim)  # same data dir: it re-adopts what survived
            back = await _wait_state(client, on_victim[0], SandboxState.RUNNING)
            assert back.state is SandboxState.RUNNING, back
            result = await (await client.get(on_victim[0])).run_shell("echo back")
            assert result.stdout == "back\n"
        finally:
            await _stop_all(c, ids)


async def test_apiserver_restart_loses_nothing(three_edges: Cluster) -> None:
    c = three_edges
    ids, failures = await _burst(c, 20, label="restart", parallelism=8)
    assert not failures
    try:
        c.apiservers[0].kill()
        async with DSecClient(c.api_urls[1], c.admin_key) as other:
            listed = await other.list_sandboxes(labels={"burst": "restart"})
            assert sorted(s.id for s in listed) == sorted(ids)
        c.start_apiserver(0)
        async with DSecClient(c.api_urls[0], c.admin_key) as again:
            listed = await again.list_sandboxes(labels={"burst": "restart"})
            assert sorted(s.id for s in listed) == sorted(ids)
            result = await (await again.get(ids[0])).run_shell("echo still here")
            assert result.stdout == "still here\n"
    finally:
        await _stop_all(c, ids)


async def test_quota_holds_under_concurrent_creates_from_two_apiservers(
    three_edges: Cluster,
) -> None:
    """Two apiservers charge one project chain in PostgreSQL: never over the quota."""
    c = three_edges
    async with DSecClient(c.api_urls[0], c.admin_key) as admin:
        await admin.create_project("rlq")
        await admin.create_project("rlq/math")
        await admin.set_quota("rlq", max_sandboxes=25)  # the parent binds the child
        await admin.create_principal("runner", default_project="rlq/math")
        await admin.grant("runner", "runtime", project="rlq")
        key = (await admin.create_key("runner")).key

    clients = [DSecClient(url, key, timeout=300) for url in c.api_urls]
    created: list[str] = []
    refused: list[QuotaExceeded] = []

    async def one(i: int) -> None:
        try:
            sb = await clients[i % 2].run_container(spec(labels={"burst": "quota"}))
            created.append(sb.id)
        except QuotaExceeded as exc:
            refused.append(exc)

    try:
        await asyncio.gather(*(one(i) for i in range(50)))
        assert len(created) == 25 and len(refused) == 25, (len(created), len(refused))
        assert refused[0].details["project"] == "rlq"
        async with DSecClient(c.api_urls[1], c.admin_key) as admin:
            usage = await admin.quota("rlq/math")
            assert usage.usage.sandboxes == 25
        with pytest.raises(PermissionDenied):
            await clients[0].run_container(spec(project="default"))
    finally:
        await _stop_all(c, created)
        for client in clients:
            await client.close()
    async with DSecClient(c.api_urls[0], c.admin_key) as admin:
        assert (await admin.quota("rlq")).usage.sandboxes == 0


async def test_keyed_create_is_made_once_across_apiservers(three_edges: Cluster) -> None:
    """Issue 13 item 7 in cluster mode: one Idempotency-Key, sent at once through both
    apiservers (each would place it on its own), makes one sandbox; a retry after the
    sandbox stopped gets it back, whatever its state; another spec is a 409."""
    c = three_edges
    key = "cluster-" + os.urandom(8).hex()
    body = {"spec": spec(labels={"t": "keyed"}).model_dump(mode="json", exclude_unset=True)}
    headers = {"Authorization": f"Bearer {c.admin_key}", "Idempotency-Key": key}
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=u, timeout=120))
            for u in c.api_urls
        ]
        answers = await asyncio.gather(
            *(clients[i % 2].post("/v1/sandboxes", json=body, headers=headers) for i in range(12))
        )
        assert all(r.status_code in (200, 201) for r in answers), [r.text for r in answers]
        ids = {r.json()["id"] for r in answers}
        assert len(ids) == 1, ids
        assert sorted(r.status_code for r in answers).count(201) == 1
        (sid,) = ids
        async with DSecClient(c.api_urls[0], c.admin_key) as a:
            listed = await a.list_sandboxes(labels={"t": "keyed"})
            assert [s.id for s in listed] == [sid]
            await (await a.get(sid)).stop()
        again = await clients[1].post("/v1/sandboxes", json=body, headers=headers)
        assert again.status_code == 200 and again.json()["id"] == sid
        assert again.json()["state"] == "stopped"
        assert again.headers.get("Idempotent-Replayed") == "true"
        other = {"spec": spec(labels={"t": "keyed"}, memory_limit_mb=96).model_dump(mode="json")}
        clash = await clients[0].post("/v1/sandboxes", json=other, headers=headers)
        assert clash.status_code == 409
        assert clash.json()["error"]["code"] == "idempotency_key_reused"


def test_file_bodies_stream_through_a_memory_limited_apiserver(three_edges: Cluster) -> None:
    """Issue 13 item 4 in cluster mode: the control routes' file bodies are forwarded to
    the sandbox's edge chunk by chunk, so an apiserver held to its idle memory plus
    less than the body's size passes a large file both ways, unharmed."""
    c = three_edges
    proc = c.apiservers[0].proc
    assert proc is not None and proc.poll() is None
    size = 256 * MiB + 777
    want = payload_sha(size)
    headers = {"Authorization": f"Bearer {c.admin_key}"}
    with (
        memory_cgroup() as cg,
        httpx.Client(
            base_url=c.api_urls[0], headers=headers, timeout=httpx.Timeout(300, connect=10)
        ) as http,
        DSecSyncClient(c.api_urls[0], c.admin_key) as client,
    ):
        sb = client.run_container(spec(labels={"t": "stream"}, memory_limit_mb=128))
        try:
            cg.add(proc.pid)
            cg.limit(cg.usage() + 120 * MiB)
            cg.reset_peak()
            r = http.put(
                f"/v1/sandboxes/{sb.id}/files",
                params={"path": "/root/big"},
                content=payload(size),
            )
            assert r.status_code == 204, r.text
            with http.stream(
                "GET", f"/v1/sandboxes/{sb.id}/files", params={"path": "/root/big"}
            ) as r:
                assert r.status_code == 200
                assert hash_body(r) == (want, size)
            missing = http.get(f"/v1/sandboxes/{sb.id}/files", params={"path": "/root/nope"})
            assert missing.status_code == 404, missing.text
            assert cg.oom_kills() == 0 and proc.poll() is None
        finally:
            cg.limit(-1 if cg.v1 else 2**62)
            sb.stop()


async def test_batch_across_edges(three_edges: Cluster) -> None:
    """A job's batch through one apiserver is placed over every edge."""
    c = three_edges
    async with DSecClient(c.api_urls[1], c.admin_key, timeout=300) as client:
        batch = await client.create_batch(spec(), count=90, job="rl-job-42")
        done = await batch.wait()
        ids = [sb.id for sb in batch.sandboxes]
        try:
            assert (done.created, done.failed, done.cancelled) == (90, 0, 0), done
            assert len(Counter(sid.split("-")[0] for sid in ids)) == 3
            listed = await client.list_sandboxes(labels={"dsec.batch": done.batch_id})
            assert len(listed) == 90 and {s.info.spec.job_id for s in listed} == {"rl-job-42"}
        finally:
            await _stop_all(c, ids)


def test_cli_lists_edges_and_refuses_bad_edge_ids(three_edges: Cluster) -> None:
    c = three_edges
    env = {**os.environ, "DSEC_URL": c.api_urls[0], "DSEC_API_KEY": c.admin_key}
    out = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "cluster", "edges", "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    edges = {e["edge_id"]: e for e in json.loads(out.stdout)}
    assert set(edges) == set(c.edges) and {e["status"] for e in edges.values()} == {"up"}
    bad = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "edge", "--join", c.api_urls[0],
         "--cluster-token", c.token, "--edge-id", "Bad_Id", "--advertise", "http://x:1"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "edge-id" in bad.stderr and "Traceback" not in bad.stderr


def test_cluster_routes_answer_garbage_with_typed_errors(three_edges: Cluster) -> None:
    c = three_edges
    api = c.api_urls[0]
    edge_auth = {"Authorization": f"Bearer {c.token}"}
    admin = {"Authorization": f"Bearer {c.admin_key}"}
    beat = f"{api}/v1/cluster/heartbeat"
    cases = [
        (httpx.post(beat, json={}), 401, "unauthenticated"),
        (httpx.post(beat, json={}, headers=admin), 401, "unauthenticated"),  # a key is no edge
        (httpx.post(beat, content=b"{not json", headers=edge_auth), 422, "invalid_argument"),
        (httpx.post(beat, json={"edge_id": "BAD"}, headers=edge_auth), 422, "invalid_argument"),
        (
            httpx.post(
                beat,
                json={
                    "edge_id": "zz1",
                    "url": "file:///etc/passwd",
                    "incarnation": "i",
                    "capacity": 1,
                    "sandboxes": 0,
                    "cpu_cores": 0,
                    "cpu_committed": 0,
                    "memory_mb": 1,
                    "memory_committed_mb": 0,
                },
                headers=edge_auth,
            ),
            422,
            "invalid_argument",
        ),
        (httpx.delete(f"{api}/v1/cluster/edges/nope", headers=admin), 404, "not_found"),
        (
            httpx.get(f"{api}/v1/sandboxes/zz9-0000000000000000", headers=admin),
            404,
            "sandbox_not_found",
        ),
        (httpx.post(f"{api}/v1/sandboxes/../token", headers=admin), 404, None),
        (
            httpx.post(f"{api}/v1/sandboxes/NOT_AN_ID/token", headers=admin),
            404,
            "sandbox_not_found",
        ),
        (httpx.get(f"{api}/v1/cluster/edges"), 401, "unauthenticated"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, (resp.request.url, resp.status_code, resp.text)
        if code is not None:
            assert resp.json()["error"]["code"] == code, resp.text
