"""What each edge keeps for itself, served by the apiservers: security events and audit
(fanned out, merged, paged with a per-edge cursor; by sandbox, routed to its edge),
trajectories, and FnCall calls (placed on an edge, retried when one is unreachable).

A smaller cluster than tests/test_cluster.py: PostgreSQL, two apiservers and two edges
in their own network namespaces (tests/cluster_env.py), all real processes."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient, NotFound
from dsec.api.events import EventKind, SecurityEvent
from dsec.api.fncall import DSecFnCallRunArgs, RunCodeRequest
from dsec.api.sandbox import SandboxState
from dsec.cluster.fanout import CURSOR_HEADER, MISSING_HEADER, parse_cursor
from dsec.cluster.fncall import ClusterFnCall
from dsec.cluster.registry import Registry
from dsec.cluster.remote import RemoteEdge
from dsec.cluster.router import ClusterEdge
from dsec.control.db import database_url, make_engine
from dsec.errors import EdgeUnavailable, InvalidArgument
from dsec.sdk import Sandbox
from tests.cluster_env import Cluster, busybox_cluster
from tests.pg import PostgresServer
from tests.test_sandbox_access import sandbox_routes

pytestmark = pytest.mark.timeout(600)

BB = DSecFnCallRunArgs(image="busybox:latest", language="sh", memory_limit_mb=64, timeout_s=5)
TAMPER = "rm /bin/ls"  # a binary_tampering event, raised before the command returns


@pytest.fixture(scope="module")
def two_edges(postgres: PostgresServer) -> Iterator[Cluster]:
    # Networks on: the hosted rollouts' scaffolds reach their edge's model gateway.
    with busybox_cluster(postgres, edges=2, apiservers=2, network=True) as c:
        yield c


def spec(job: str) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64, job_id=job)


@pytest.fixture
async def spread(
    two_edges: Cluster, request: pytest.FixtureRequest
) -> AsyncIterator[list[Sandbox]]:
    """One sandbox of the test's job on each edge (created through an apiserver)."""
    c = two_edges
    job = "fan-" + request.node.name.removeprefix("test_")[:40].replace("_", "-")
    async with DSecClient(c.api_urls[0], c.admin_key, timeout=120) as client:
        made: list[Sandbox] = []
        by_edge: dict[str, Sandbox] = {}
        try:
            while len(by_edge) < 2 and len(made) < 12:
                sb = await client.run_container(spec(job))
                made.append(sb)
                by_edge.setdefault(sb.id.split("-")[0], sb)
            assert len(by_edge) == 2, f"placement used one edge for {len(made)} sandboxes"
            yield [by_edge[e] for e in sorted(by_edge)]
        finally:
            for sb in made:
                with contextlib.suppress(EdgeUnavailable):  # its edge is away
                    await sb.stop()


def _request(c: Cluster, api: int, path: str, **params: str | int | None) -> httpx.Response:
    """A plain GET, to read the headers the SDK does not show."""
    headers = {"Authorization": f"Bearer {c.admin_key}"}
    query = {k: v for k, v in params.items() if v is not None}
    return httpx.get(c.api_urls[api] + path, params=query, headers=headers, timeout=60)


def _get(c: Cluster, api: int, path: str, **params: str | int | None) -> httpx.Response:
    resp = _request(c, api, path, **params)
    assert resp.status_code == 200, resp.text
    return resp


async def _events(client: DSecClient, job: str, count: int) -> list[SecurityEvent]:
    deadline = time.monotonic() + 30
    while True:
        events = await client.events(job=job)
        if len(events) >= count or time.monotonic() > deadline:
            return list(events)
        await asyncio.sleep(0.2)


async def test_events_of_two_edges_merged_and_paged(
    two_edges: Cluster, spread: list[Sandbox]
) -> None:
    c = two_edges
    job = spread[0].info.spec.job_id
    assert job is not None
    for sb in spread:
        await sb.run_shell(TAMPER)
    for url in c.api_urls:  # either apiserver: the same merged answer
        async with DSecClient(url, c.admin_key) as client:
            events = await client.events(job=job)
            assert {e.sandbox_id for e in events} == {sb.id for sb in spread}
            assert all(e.kind is EventKind.BINARY_TAMPERING for e in events)
            assert [e.time for e in events] == sorted(e.time for e in events)
            with pytest.raises(InvalidArgument, match="cursor"):
                await client.events(job=job, since_seq=events[0].seq)

    first = _get(c, 0, "/v1/events", job_id=job)
    assert MISSING_HEADER not in first.headers
    assert set(parse_cursor(first.headers[CURSOR_HEADER])) == set(c.edges)
    # Page one row at a time with the cursor (the SDK's pages): every row once, then
    # nothing; a row written later on one edge comes after the cursor, not before it.
    async with DSecClient(c.api_urls[1], c.admin_key) as client:
        seen: list[tuple[str, int]] = []
        page = await client.events_page(job=job, limit=1)
        for _ in range(5):
            if not page.items:
                break
            seen += [(e.sandbox_id, e.seq) for e in page.items]
            page = await client.events_page(job=job, limit=1, cursor=page.cursor)
        assert sorted(seen) == sorted((r["sandbox_id"], r["seq"]) for r in first.json())
        assert page.missing == []
        await spread[1].run_shell("rm /bin/cat")
        deadline = time.monotonic() + 30
        while not page.items and time.monotonic() < deadline:
            page = await client.events_page(job=job, cursor=page.cursor)
        assert [e.sandbox_id for e in page.items] == [spread[1].id]
        # One sandbox: its edge's own seq as the cursor, the same on one node
        one = await client.events_page(sandbox=spread[1].id, limit=1)
        assert one.cursor == f"@{one.items[0].seq}"
        rest = await client.events_page(sandbox=spread[1].id, cursor=one.cursor)
        assert [e.detail["changes"] for e in rest.items] == [["deleted /bin/cat"]]
    # The CLI pages the same way, and says how to go on.
    env = {"DSEC_URL": c.api_urls[0], "DSEC_API_KEY": c.admin_key, "PATH": "/usr/bin:/bin"}
    env["COLUMNS"] = "400"  # whole sandbox ids in the table
    cli = [sys.executable, "-m", "dsec.cli.main", "events", "--job", job]
    res = await asyncio.to_thread(
        subprocess.run, [*cli, "--cursor", ""], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert spread[1].id in res.stdout
    printed = res.stdout.split("next: --cursor '")[1].split("'")[0]
    assert parse_cursor(printed).keys() == set(c.edges)
    res = await asyncio.to_thread(
        subprocess.run, [*cli, "--since", "1"], env=env, capture_output=True, text=True
    )
    assert res.returncode != 0 and "cursor" in res.stderr + res.stdout


async def test_audit_of_one_sandbox_is_its_edges(two_edges: Cluster, spread: list[Sandbox]) -> None:
    c = two_edges
    sb = spread[1]
    await sb.run_shell("echo one > /tmp/a && cat /tmp/a")
    edge = c.edges[sb.id.split("-")[0]]
    async with (
        DSecClient(edge.url, c.token) as direct,
        DSecClient(c.api_urls[1], c.admin_key) as client,
    ):
        mine = await direct.audit(sandbox=sb.id)
        assert len(mine) >= 2
        routed = await client.audit(sandbox=sb.id)
        assert routed[: len(mine)] == mine  # the edge's own rows and seqs
        # since_seq on one sandbox means what it means on one node
        assert (await client.audit(sandbox=sb.id, since_seq=mine[0].seq))[: len(mine) - 1] == (
            mine[1:]
        )
        assert await client.audit(sandbox=f"{edge.edge_id}-nosuchsandbox") == []
        everyone = await client.audit(job=sb.info.spec.job_id)
        assert {r.sandbox_id for r in everyone} == {s.id for s in spread}


async def test_fncall_through_either_apiserver(two_edges: Cluster) -> None:
    c = two_edges
    for url in c.api_urls:
        async with DSecClient(url, c.admin_key, timeout=120) as client:
            r = await client.run_code(BB, "read x; echo out $x", stdin="in\n")
            assert (r.status, r.stdout) == ("ok", "out in\n"), r
            r = await client.run_code(BB, "exit 3")
            assert (r.status, r.exit_code) == ("runtime_error", 3)
            j = await client.judge(
                BB, "read a b; echo $((a + b))", tests=[("1 2\n", "3"), ("2 2\n", "5")]
            )
            assert [t.verdict for t in j.tests] == ["AC", "WA"], j
            assert {lang.name for lang in await client.fncall_languages()} >= {"sh", "python"}
    async with DSecClient(c.api_urls[0], c.admin_key, timeout=120) as client:
        pool = await client.warm_pool(BB, size=2)
        assert pool.ready >= 2
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the pools view is refreshed every second
            pools = await client.fncall_pools()
            if sum(p.ready for p in pools if p.image == BB.image) >= 2:
                break
            await asyncio.sleep(0.3)
        assert sum(p.ready for p in pools if p.image == BB.image) >= 2, pools
        results = await asyncio.gather(*(client.run_code(BB, f"echo {i}") for i in range(8)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


async def test_trajectory_through_an_apiserver(two_edges: Cluster, spread: list[Sandbox]) -> None:
    c = two_edges
    sb = spread[0]
    job = sb.info.spec.job_id
    assert job is not None
    bump = "echo x >> /tmp/count && wc -l < /tmp/count"
    async with (
        DSecClient(c.api_urls[0], c.admin_key) as a,
        DSecClient(c.api_urls[1], c.admin_key) as b,
    ):
        traj = a.trajectory(job, "r0")
        first = [(await traj.run_shell(sb.id, bump)).stdout.strip() for _ in range(3)]
        assert first == ["1", "2", "3"]
        again = b.trajectory(job, "r0")  # a resumed trainer, through the other apiserver
        second = [(await again.run_shell(sb.id, bump)).stdout.strip() for _ in range(3)]
        assert second == first and again.replayed == 3 and again.executed == 0
        # The plain exec route with a trajectory ref: the same log, on the same edge
        assert (await sb.run_shell(bump, trajectory=again)).stdout.strip() == "4"
        info = await again.info()
        assert info.steps == 4 and info.sandboxes == [sb.id]
        assert [r.step for r in await again.records()] == [0, 1, 2, 3]
        assert [i.rollout_id for i in await b.trajectories(job)] == ["r0"]
        assert (await b.export_trajectories(job)).count("\n") == 4
        assert await b.discard_trajectory_steps(job, "r0", 2) == 2


ROLLOUT_STEPS = 2
SCAFFOLD = """i=0
while [ $i -lt STEPS ]; do
  body='{"messages":[{"role":"user","content":"'"$DSEC_ROLLOUT_ID step $i"'"}]}'
  until wget -q -O /dev/null --header "Authorization: Bearer $OPENAI_API_KEY" \
      --header 'Content-Type: application/json' --post-data "$body" \
      "$OPENAI_BASE_URL/chat/completions" 2>/dev/null; do sleep 0.3; done
  i=$((i+1))
done
""".replace("STEPS", str(ROLLOUT_STEPS))


def test_rollouts_through_the_cluster(two_edges: Cluster) -> None:
    """Hosted rollouts through the apiservers (dsec.cluster.rollouts): started through
    one, spread over both edges, pointed at the trainer through the other (the endpoint
    fans out), listed, waited, handed off and acknowledged through either; a second
    tenant sees none of it."""
    from dsec import (
        DSecSyncClient,
        ModelEndpoint,
        NotFound,
        PermissionDenied,
        RolloutSpec,
        RolloutState,
    )
    from dsec.api.rollouts import RolloutInfo
    from tests.scripted_trainer import ScriptedTrainer

    c = two_edges
    job = "cl-rollouts"
    trainer = ScriptedTrainer(host=c.net.host_ip).start()
    dead = ModelEndpoint(base_url=f"http://{c.net.host_ip}:9/v1")  # nobody listens
    made: list[str] = []
    try:
        with (
            DSecSyncClient(c.api_urls[0], c.admin_key, timeout=120) as a0,
            DSecSyncClient(c.api_urls[1], c.admin_key, timeout=120) as a1,
        ):

            def start(scaffold: str) -> str:
                ro = a0.start_rollout(
                    RolloutSpec(
                        job_id=job,
                        sandbox=DSecContainerRunArgs(
                            container_image="busybox:latest", memory_limit_mb=64
                        ),
                        scaffold=scaffold,
                        model=dead,
                        timeout=180,
                        pause_after=60,
                    )
                )
                made.append(ro.id)
                return ro.id

            ids: list[str] = []
            while len({i.split("-")[0] for i in ids}) < 2 and len(ids) < 6:
                ids.append(start(SCAFFOLD))
            assert len({i.split("-")[0] for i in ids}) == 2, ids
            assert {r.id for r in a1.list_rollouts(job)} == set(ids)
            # Held by the dead endpoint until the other apiserver points every edge's
            # rollouts of the job at the trainer.
            deadline = time.monotonic() + 60
            states: list[RolloutInfo] = []
            while time.monotonic() < deadline:
                states = [a1.get_rollout(i) for i in ids]
                if all(s.state is RolloutState.WAITING_FOR_MODEL for s in states):
                    break
                time.sleep(0.3)
            assert all(s.state is RolloutState.WAITING_FOR_MODEL for s in states), states
            url = f"http://{c.net.host_ip}:{trainer.port}/v1"
            assert a1.set_model_endpoint(job, ModelEndpoint(base_url=url)).rollouts == len(ids)
            for i in ids:
                final = a1.wait_rollout(i, timeout=120)
                assert final.state is RolloutState.FINISHED, final
                assert final.model_calls == ROLLOUT_STEPS, final
            assert sorted(trainer.prompts()) == sorted(
                f"{i} step {n}" for i in ids for n in range(ROLLOUT_STEPS)
            )
            extra = start("sleep 60")
            assert a1.cancel_rollout(extra).state is RolloutState.CANCELLED
            done = a0.finished_rollouts(job)
            assert {d.rollout.id for d in done} == {*ids, extra}
            calls = [s for d in done for s in d.steps if s.op == "model_call"]
            assert len(calls) == ROLLOUT_STEPS * len(ids)
            res = a1.ack_rollouts(job, [*ids, extra, "nowhere-ro00"])
            assert sorted(res.acked) == sorted([*ids, extra])
            assert res.unknown == ["nowhere-ro00"]
            assert a0.ack_rollouts(job, ids).already == ids
            assert a0.finished_rollouts(job) == []
            # Another tenant, through the cluster: nothing to see, nothing to change.
            a0.create_project("cl-tenant")
            a0.create_principal("cl-tenant", default_project="cl-tenant")
            a0.grant("cl-tenant", "runtime", project="cl-tenant")
            key = a0.create_key("cl-tenant").key
            with DSecSyncClient(c.api_urls[1], key, timeout=60) as t:
                with pytest.raises(NotFound):
                    t.get_rollout(ids[0])
                with pytest.raises(PermissionDenied):
                    t.list_rollouts(job)
                with pytest.raises(PermissionDenied):
                    t.set_model_endpoint(job, dead)
    finally:
        with DSecSyncClient(c.api_urls[0], c.admin_key, timeout=120) as a0:
            for rid in made:
                with contextlib.suppress(Exception):
                    a0.cancel_rollout(rid)
        trainer.stop()


def test_a_second_tenant_cannot_touch_sandboxes_through_the_cluster(two_edges: Cluster) -> None:
    """Tenant isolation on a cluster apiserver (dsec.apiserver.sandboxaccess): another
    project's sandbox is 404 on every sandbox route (the app's routes walked, as in
    tests/test_sandbox_access.py) including the cluster's own token routes; lists,
    stats and the fanned-out audit log are the tenant's own; and the edge itself takes
    neither the tenant's API key nor its own sandbox's token for another sandbox."""
    c = two_edges
    tag = secrets.token_hex(3)
    with DSecSyncClient(c.api_urls[0], c.admin_key, timeout=120) as admin:
        admin.create_project(f"cl-{tag}")
        admin.create_principal(f"tenant-{tag}", default_project=f"cl-{tag}")
        admin.grant(f"tenant-{tag}", "runtime", project=f"cl-{tag}")
        key = admin.create_key(f"tenant-{tag}").key
        theirs = admin.run_sandbox(spec(f"cl-admin-{tag}"))
        try:
            with DSecSyncClient(c.api_urls[1], key, timeout=120) as tenant:
                mine = tenant.run_sandbox(
                    DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
                )
                try:
                    with pytest.raises(NotFound):
                        tenant.get(theirs.id)
                    assert [s.id for s in tenant.list_sandboxes()] == [mine.id]
                    _cluster_attacks(c, key, theirs.id, mine.id)
                finally:
                    mine.stop()
        finally:
            theirs.stop()


def _cluster_attacks(c: Cluster, key: str, theirs: str, mine: str) -> None:
    h = {"Authorization": f"Bearer {key}", "X-API-KEY": key}
    checked = {
        "/v1/sandboxes/{sandbox_id}",
        "/v1/sandboxes/{sandbox_id}/exec",
        "/v1/sandboxes/{sandbox_id}/files",
        "/v1/sandboxes/{sandbox_id}/token",
        "/v1/sandboxes/{sandbox_id}/view-token",
        "/v1/sandboxes/{sandbox_id}/network",
        "/v1/sandboxes/{sandbox_id}/verify",
        "/v1/sandboxes/{sandbox_id}/fork",
        "/v1/sandboxes/{sandbox_id}/pack",
    }
    with httpx.Client(base_url=c.api_urls[0], headers=h, timeout=60) as http:
        for method, path in sandbox_routes():
            if method == "WS":
                continue
            r = http.request(
                method, path.replace("{sandbox_id}", theirs), params={"path": "/"}, content=b"{}"
            )
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            if path in checked:
                assert r.json()["error"]["code"] == "sandbox_not_found", (method, path, r.text)
        stats = [s["id"] for s in http.get("/v1/stats").json()]
        assert mine in stats and theirs not in stats
        assert http.get("/v1/audit").status_code == 403
        assert http.get("/v1/audit", params={"sandbox_id": theirs}).status_code == 404
        assert http.get("/v1/audit", params={"sandbox_id": mine}).status_code == 200
        own = http.post(f"/v1/sandboxes/{mine}/token").json()
    # Around the apiserver, straight to the edges: the tenant's key is no key there, and
    # its own sandbox's token opens nothing else.
    for edge in c.edges.values():
        for cred in (key, own["token"]):
            r = httpx.get(
                f"{edge.url}/v1/edge/sandboxes/{theirs}/fs/stat",
                params={"path": "/"},
                headers={"Authorization": f"Bearer {cred}"},
                timeout=30,
            )
            assert r.status_code in (401, 403), (edge.edge_id, r.status_code, r.text)
        r = httpx.get(
            f"{edge.url}/v1/sandboxes/{theirs}", headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 401, r.text


async def test_down_edge_is_reported_missing(two_edges: Cluster, spread: list[Sandbox]) -> None:
    c = two_edges
    job = spread[0].info.spec.job_id
    for sb in spread:
        await sb.run_shell(TAMPER)
    async with DSecClient(c.api_urls[0], c.admin_key) as client:
        # Read once: a query flushes the edge's log (a kill loses the last 50 ms of it)
        assert len(await _events(client, job or "", 2)) == 2
    victim_sb, alive_sb = spread[1], spread[0]
    victim = c.edges[victim_sb.id.split("-")[0]]
    victim.proc.kill()
    try:
        page = _get(c, 0, "/v1/events", job_id=job)
        assert page.headers[MISSING_HEADER] == victim.edge_id
        assert [r["sandbox_id"] for r in page.json()] == [alive_sb.id]
        # ...and its old position stays in the cursor: nothing of it is skipped later
        assert victim.edge_id not in parse_cursor(page.headers[CURSOR_HEADER])
        strict = _request(c, 1, "/v1/events", job_id=job, complete="true")
        assert strict.status_code == 503 and strict.json()["error"]["code"] == "edge_unavailable"
        async with DSecClient(c.api_urls[1], c.admin_key, timeout=120) as client:
            with pytest.raises(EdgeUnavailable):
                await client.audit(sandbox=victim_sb.id)
            # FnCall calls land on the edge that is left
            for i in range(4):
                assert (await client.run_code(BB, f"echo {i}")).stdout == f"{i}\n"
        await _dead_edge_first(c, victim.edge_id)
    finally:
        c.start_edge(victim)  # same data dir: it re-adopts what survived
        c.wait_edges_up(2)
    async with DSecClient(c.api_urls[0], c.admin_key) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (await client.get(victim_sb.id)).info.state is SandboxState.RUNNING:
                break
            await asyncio.sleep(0.2)
        events = await _events(client, job or "", 2)
        assert {e.sandbox_id for e in events} == {s.id for s in spread}
    # The cursor of the answer without it picks the edge's rows up now
    later = _get(c, 0, "/v1/events", job_id=job, cursor=page.headers[CURSOR_HEADER]).json()
    assert [r["sandbox_id"] for r in later] == [victim_sb.id]


class _DeadFirst(ClusterFnCall):
    """Placement that asks a given edge first, up or not (here: one that was killed)."""

    def __init__(self, router: ClusterEdge, first: str) -> None:
        super().__init__(router)
        self.first = first

    def candidates(self, args: DSecFnCallRunArgs) -> list[RemoteEdge]:
        rest = [r for r in super().candidates(args) if r.edge_id != self.first]
        return [self.router._remotes[self.first], *rest]


async def _dead_edge_first(c: Cluster, dead: str) -> None:
    """A call whose first edge does not accept connections runs once, on the next."""
    engine = make_engine(database_url(c.db_url))
    router = ClusterEdge(Registry(engine), c.token)
    fncall = _DeadFirst(router, dead)
    try:
        await router.start()
        result = await fncall.run_code(RunCodeRequest(args=BB, code="echo once"))
        assert (result.status, result.stdout) == ("ok", "once\n")
    finally:
        await fncall.close()
        await router.close()
        await engine.dispose()
