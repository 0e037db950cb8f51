"""IAM: nested projects, bounded delegation, quotas charged along the chain.

Unit tests run against SQLite and a real PostgreSQL (tests.pg); the end-to-end tests
go through the HTTP API of the session platform (`dsec up`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from dsec import DSecClient
from dsec.api.iam import PrincipalCreate, QuotaLimits, Role
from dsec.api.spec import DSecContainerRunArgs
from dsec.control.db import make_engine, migrate, sqlite_url
from dsec.control.iam import IAM, ROOT, Request
from dsec.control.iam_tables import ChargeRow, UsageRow
from dsec.errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from tests.conftest import PlatformProcess


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "control.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(db_url)
    try:
        await migrate(eng)
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def iam(engine: AsyncEngine) -> AsyncIterator[IAM]:
    iam = IAM(engine, cache_ttl=0.0)
    try:
        await iam.ensure_bootstrap()
        yield iam
    finally:
        await iam.close()


async def _usage(iam: IAM, project: str) -> tuple[int, float, int]:
    q = await iam.quota("admin", project)
    return q.usage.sandboxes, q.usage.cpu_cores, q.usage.memory_mb


async def test_bootstrap_is_idempotent(iam: IAM) -> None:
    await iam.ensure_bootstrap()
    assert await iam.role_on("admin", "default") is Role.ADMIN
    assert await iam.role_on("admin", ROOT) is Role.ADMIN
    assert [p.path for p in await iam.projects("admin")] == ["default"]
    assert await iam.default_project("nobody") == "default"


async def test_nested_charges_go_along_the_chain(iam: IAM) -> None:
    for p in ("rl", "rl/math", "rl/math/job-1", "rl/code"):
        await iam.create_project("admin", p)
    await iam.set_quota("admin", "rl", QuotaLimits(max_sandboxes=3, cpu_cores=2.0))
    await iam.set_quota("admin", "rl/math", QuotaLimits(memory_mb=300))
    await iam.charge("rl/math/job-1", "s1", 0.7, 100)
    await iam.charge("rl/math", "s2", 0.1, 100)
    assert await _usage(iam, "rl/math/job-1") == (1, 0.7, 100)
    assert await _usage(iam, "rl/math") == (2, 0.8, 200)
    assert await _usage(iam, "rl") == (2, 0.8, 200)
    with pytest.raises(QuotaExceeded) as exc:  # rl/math's memory: 200 + 101 > 300
        await iam.charge("rl/math/job-1", "s3", 0.1, 101)
    assert exc.value.details == {
        "project": "rl/math",
        "resource": "memory_mb",
        "limit": 300,
        "used": 200,
        "requested": 101,
    }
    assert exc.value.status == 429
    with pytest.raises(QuotaExceeded) as exc:  # rl's cpu, though rl/code has no limit
        await iam.charge("rl/code", "s3", 1.3, 1)
    assert exc.value.details["project"] == "rl"
    assert exc.value.details["resource"] == "cpu_cores"
    assert exc.value.details["used"] == pytest.approx(0.8)
    await iam.charge("rl/code", "s3", 1.2, 1)  # exactly at the limit is fine
    with pytest.raises(QuotaExceeded, match="sandboxes"):
        await iam.charge("rl/code", "s4", 0.0001, 1)
    assert await _usage(iam, "rl") == (3, 2.0, 201)  # refused charges left no trace
    with pytest.raises(AlreadyExists):
        await iam.charge("default", "s1", 0.1, 1)
    with pytest.raises(NotFound):
        await iam.charge("rl/nope", "s9", 0.1, 1)

    assert await iam.release("s1") is True
    assert await iam.release("s1") is False  # idempotent
    assert await _usage(iam, "rl/math/job-1") == (0, 0.0, 0)
    assert await _usage(iam, "rl") == (2, 1.3, 101)
    assert await iam.release_many(["s2", "s3", "never"]) == 2
    assert await _usage(iam, "rl") == (0, 0.0, 0)


async def test_charge_many_charges_what_fits(iam: IAM) -> None:
    await iam.create_project("admin", "batch")
    await iam.create_project("admin", "batch/job")
    await iam.set_quota("admin", "batch", QuotaLimits(max_sandboxes=5))
    reqs = [Request(f"b{i}", 0.5, 64) for i in range(8)]
    assert await iam.charge_many("batch/job", reqs) == 5
    assert await iam.charge_many("batch/job", [Request("more", 0.5, 64)]) == 0
    assert await _usage(iam, "batch") == (5, 2.5, 320)
    assert await iam.release_many([r.sandbox_id for r in reqs]) == 5
    assert await _usage(iam, "batch/job") == (0, 0.0, 0)


async def test_quota_bounds_between_parent_and_child(iam: IAM) -> None:
    await iam.create_project("admin", "team")
    await iam.create_project("admin", "team/a")
    await iam.set_quota("admin", "team", QuotaLimits(max_sandboxes=10, cpu_cores=4))
    with pytest.raises(InvalidArgument, match="exceeds the limit of the ancestor 'team'"):
        await iam.set_quota("admin", "team/a", QuotaLimits(max_sandboxes=11))
    await iam.set_quota("admin", "team/a", QuotaLimits(max_sandboxes=10, cpu_cores=1.5))
    with pytest.raises(InvalidArgument, match="below the limit of the sub-project"):
        await iam.set_quota("admin", "team", QuotaLimits(max_sandboxes=5))
    # below current usage: accepted, reported; nothing is stopped
    await iam.charge("team/a", "x1", 1.0, 10)
    info = await iam.set_quota("admin", "team/a", QuotaLimits(cpu_cores=0.5))
    assert info.usage.cpu_cores == 1.0 and info.limits.cpu_cores == 0.5
    assert info.warnings and "below current usage" in info.warnings[0]
    with pytest.raises(QuotaExceeded):
        await iam.charge("team/a", "x2", 0.1, 10)
    await iam.release("x1")
    with pytest.raises(Conflict, match="not empty"):
        await iam.delete_project("admin", "team")
    await iam.delete_project("admin", "team/a")
    await iam.delete_project("admin", "team")
    with pytest.raises(NotFound):
        await iam.quota("admin", "team")


async def test_delegation_is_bounded(iam: IAM) -> None:
    for name in ("alice", "bob", "carol"):
        await iam.create_principal("admin", PrincipalCreate(name=name, kind="human"))
    await iam.create_project("admin", "rl")
    await iam.grant("admin", "alice", "rl", Role.ADMIN)
    # alice administers rl's subtree, and nothing else
    await iam.create_project("alice", "rl/math")
    with pytest.raises(PermissionDenied):
        await iam.create_project("alice", "other")
    with pytest.raises(PermissionDenied):
        await iam.grant("alice", "bob", ROOT, Role.RUNTIME)
    with pytest.raises(PermissionDenied):
        await iam.grant("alice", "bob", "default", Role.RUNTIME)
    # she may not raise her own project's quota, only its children's
    with pytest.raises(PermissionDenied, match="on every project"):
        await iam.set_quota("alice", "rl", QuotaLimits(max_sandboxes=1000))
    await iam.set_quota("admin", "rl", QuotaLimits(max_sandboxes=100))
    await iam.set_quota("alice", "rl/math", QuotaLimits(max_sandboxes=50))
    with pytest.raises(InvalidArgument):
        await iam.set_quota("alice", "rl/math", QuotaLimits(max_sandboxes=101))
    await iam.grant("alice", "bob", "rl/math", Role.BUILDER)
    assert await iam.role_on("bob", "rl/math/deep/er") is Role.BUILDER  # inherited
    assert await iam.role_on("bob", "rl") is None
    # a builder neither grants nor creates projects
    with pytest.raises(PermissionDenied):
        await iam.grant("bob", "carol", "rl/math", Role.RUNTIME)
    with pytest.raises(PermissionDenied):
        await iam.create_project("bob", "rl/math/sub")
    with pytest.raises(PermissionDenied):
        await iam.create_principal("bob", PrincipalCreate(name="bots"))
    # bindings list own and inherited roles
    listed = {(b.principal, b.role, b.inherited_from) for b in await iam.bindings("bob", "rl/math")}
    assert ("alice", Role.ADMIN, "rl") in listed
    assert ("admin", Role.ADMIN, ROOT) in listed
    assert ("bob", Role.BUILDER, None) in listed
    # revoking needs admin there; the bootstrap admin cannot be locked out
    with pytest.raises(PermissionDenied):
        await iam.revoke("bob", "alice", "rl")
    assert await iam.revoke("alice", "bob", "rl/math") is True
    assert await iam.role_on("bob", "rl/math") is None
    with pytest.raises(Conflict):
        await iam.revoke("admin", "admin", ROOT)
    with pytest.raises(NotFound):
        await iam.grant("admin", "ghost", "rl", Role.RUNTIME)
    with pytest.raises(InvalidArgument):
        await iam.grant("admin", "bob", "Bad Path", Role.RUNTIME)


async def test_jobs_belong_to_the_project_that_first_used_them(iam: IAM) -> None:
    """dsec.control.jobs: the first use of a job id claims it for the caller's project;
    another tenant may neither use nor read it; two apiservers racing for a new id
    agree on one owner; without IAM everything passes."""
    from dsec.control.jobs import JobAccess

    for name, project in (("alice", "team-a"), ("bob", "team-b")):
        await iam.create_project("admin", project)
        await iam.create_principal(
            "admin", PrincipalCreate(name=name, kind="agent", default_project=project)
        )
        await iam.grant("admin", name, project, Role.RUNTIME)
    await iam.create_project("admin", "team-a/sub")
    jobs, other = JobAccess(iam), JobAccess(iam)  # two apiservers, one database
    assert await jobs.claim("alice", "j1", None, "x") == "team-a"  # her default project
    assert await other.owner("j1") == "team-a"
    await other.require("alice", "j1", "x")
    # the endpoint of a known job (no project named): checked on the job's project
    assert await other.claim("alice", "j1", None, "x") == "team-a"
    # alice may put work of her job in a sub-project she has a role on
    assert await jobs.claim("alice", "j1", "team-a/sub", "x") == "team-a/sub"
    for attempt in (
        jobs.claim("bob", "j1", None, "x"),
        jobs.claim("bob", "j1", "team-b", "x"),  # the id reused in his own project
        jobs.require("bob", "j1", "x"),
        other.require("bob", "j1", "x"),
        jobs.claim("bob", "j2", "team-a", "x"),  # a project he has no role on
    ):
        with pytest.raises(PermissionDenied):
            await attempt
    assert await jobs.owner("j2") is None  # a refused claim claims nothing
    # a job nobody owns counts as the default project's (work from before ownership)
    with pytest.raises(PermissionDenied):
        await jobs.require("bob", "old-job", "x")
    await jobs.require("admin", "old-job", "x")
    assert await jobs.may_see("alice", "team-a/sub") and not await jobs.may_see("bob", "team-a")
    assert not await jobs.may_see("bob", None) and await jobs.may_see("admin", None)
    # a race for a fresh id: one owner, the loser refused
    got = await asyncio.gather(
        jobs.claim("alice", "race", None, "x"),
        other.claim("bob", "race", None, "x"),
        return_exceptions=True,
    )
    assert sum(isinstance(g, PermissionDenied) for g in got) == 1, got
    assert await jobs.owner("race") in {"team-a", "team-b"}
    # without IAM (one user): no checks, nothing recorded
    off = JobAccess(None)
    assert not off.enforced
    assert await off.claim("anyone", "j1", None, "x") is None
    await off.require("anyone", "j1", "x")
    assert await off.may_see("anyone", "team-a")


async def test_reconcile_releases_charges_of_vanished_sandboxes(iam: IAM) -> None:
    await iam.charge("default", "e7-00000000000000a1", 1, 10)
    await iam.charge("default", "e7-00000000000000a2", 1, 10)
    await iam.charge("default", "e8-00000000000000a3", 1, 10)  # another edge's
    pending = iam.provisional_id()
    await iam.charge("default", pending, 1, 10)
    gone = await iam.reconcile({"e7-00000000000000a1"}, prefix="e7-", pending_older_than=0)
    assert sorted(gone) == sorted(["e7-00000000000000a2", pending])
    assert await _usage(iam, "default") == (2, 2.0, 20)


async def _consistent(engine: AsyncEngine, project: str) -> tuple[int, int]:
    """(usage.sandboxes, number of charges under ``project``) read in one go."""
    async with engine.connect() as conn:
        used = await conn.scalar(select(UsageRow.sandboxes).where(UsageRow.project == project))
        charged = await conn.scalar(
            select(func.count())
            .select_from(ChargeRow)
            .where((ChargeRow.project == project) | ChargeRow.project.startswith(project + "/"))
        )
    return int(used or 0), int(charged or 0)


async def test_two_apiservers_never_overrun_a_quota(db_url: str) -> None:
    """Two engines (two apiservers; on SQLite two connections) charge and release one
    quota tree concurrently, on different branches so lock chains overlap: usage never
    exceeds the limit, no deadlock, and usage ends equal to the charges table."""
    engines = [make_engine(db_url) for _ in range(2)]
    iams: list[IAM] = []
    try:
        await migrate(engines[0])
        iams.extend(IAM(e, cache_ttl=0.0) for e in engines)
        await iams[0].ensure_bootstrap()
        await iams[1].ensure_bootstrap()  # concurrently-safe and idempotent
        for p in ("rl", "rl/a", "rl/b", "rl/a/x"):
            await iams[0].create_project("admin", p)
        limit = 12
        await iams[0].set_quota("admin", "rl", QuotaLimits(max_sandboxes=limit, cpu_cores=9.0))
        held: set[str] = set()
        peak = 0
        refused = 0

        async def worker(n: int) -> None:
            nonlocal peak, refused
            rng = random.Random(n)
            iam = iams[n % 2]
            for i in range(40):
                sid = f"w{n}-{i}"
                try:
                    await iam.charge(rng.choice(["rl", "rl/a", "rl/b", "rl/a/x"]), sid, 0.75, 8)
                except QuotaExceeded:
                    refused += 1
                    continue
                held.add(sid)
                peak = max(peak, len(held))
                if rng.random() < 0.6:
                    victim = rng.choice(sorted(held))
                    held.discard(victim)
                    await iams[rng.randrange(2)].release(victim)

        async def watch() -> None:
            while True:
                used, _ = await _consistent(engines[1], "rl")
                assert used <= limit
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(8))), 120)
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        assert peak <= limit and refused > 0
        used, charged = await _consistent(engines[0], "rl")
        assert used == charged == len(held)
        q = await iams[1].quota("admin", "rl")
        assert q.usage.cpu_cores == pytest.approx(0.75 * len(held))
        assert q.usage.memory_mb == 8 * len(held)
        assert await iams[0].release_many(sorted(held)) == len(held)
        assert await _consistent(engines[1], "rl") == (0, 0)
    finally:
        for i in iams:
            await i.close()
        for e in engines:
            await e.dispose()


# -- end to end through the HTTP API -----------------------------------------------------


async def test_runtime_key_over_quota_gets_429_and_403_outside_its_project(
    client: DSecClient, platform: PlatformProcess, busybox_image: str
) -> None:
    tag = secrets.token_hex(3)
    project, runner = f"e2e-{tag}", f"runner-{tag}"
    await client.create_project(project)
    await client.create_project(f"{project}/job")
    q = await client.set_quota(project, max_sandboxes=1, memory_mb=512)
    assert q.limits.max_sandboxes == 1 and q.usage.sandboxes == 0
    await client.create_principal(runner, default_project=f"{project}/job")
    await client.grant(runner, "runtime", project=project)
    created = await client.create_key(runner)
    assert created.key.startswith("dsk_") and created.principal == runner
    assert any(k.id == created.id for k in await client.keys(runner))

    other = DSecClient(platform.url, created.key)
    await other.open()
    try:
        args = DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64)
        sb = await other.run_container(args)  # charged to its default project
        try:
            assert sb.info.spec.project == f"{project}/job"
            assert (await client.quota(project)).usage.sandboxes == 1
            with pytest.raises(QuotaExceeded) as exc:
                await other.run_container(args)
            assert exc.value.details["project"] == project
            assert exc.value.details["resource"] == "sandboxes"
            assert exc.value.details["limit"] == 1
            with pytest.raises(PermissionDenied):  # no role on the default project
                await other.run_container(args.model_copy(update={"project": "default"}))
            with pytest.raises(PermissionDenied):  # runtime may not make projects
                await other.create_project(f"{project}/job/sub")
            with pytest.raises(PermissionDenied):  # ... nor raise its own quota
                await other.set_quota(project, max_sandboxes=100)
        finally:
            await sb.stop()
        assert (await client.quota(project)).usage.sandboxes == 0  # released on stop
        sb2 = await other.run_container(args)
        await sb2.stop()

        # raw HTTP: the error envelope and status codes
        async with httpx.AsyncClient(
            base_url=platform.url, headers={"Authorization": f"Bearer {created.key}"}
        ) as raw:
            r = await raw.post("/v1/projects", json={"path": f"{project}/x"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
            r = await raw.get("/v1/projects/no-such-project")
            assert r.status_code in (403, 404)
            r = await raw.post("/v1/projects", json={"path": "Bad//path"})
            assert r.status_code == 422
            r = await raw.get(f"/v1/projects/{project}/-/quota")
            assert r.status_code == 200 and r.json()["limits"]["max_sandboxes"] == 1
        async with httpx.AsyncClient(
            base_url=platform.url, headers={"Authorization": f"Bearer {platform.api_key}"}
        ) as admin:
            assert (await admin.post("/v1/projects", json={"path": project})).status_code == 409
            assert (await admin.get("/v1/projects/nope-" + tag)).status_code == 404
            r = await admin.put(f"/v1/projects/{project}/job/-/quota", json={"max_sandboxes": 2})
            assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument"

        await client.revoke_key(created.id)
        with pytest.raises(Exception, match="unknown or revoked"):
            await other.run_container(args)
    finally:
        await other.close()
    await client.delete_project(f"{project}/job")
    await client.delete_project(project)
    assert project not in [p.path for p in await client.projects()]


async def test_a_sandbox_that_ends_by_itself_gives_its_charge_back(
    client: DSecClient, busybox_image: str
) -> None:
    project = "ttl-" + secrets.token_hex(3)
    await client.create_project(project)
    await client.set_quota(project, max_sandboxes=1)
    sb = await client.run_container(
        DSecContainerRunArgs(
            container_image=busybox_image, memory_limit_mb=64, ttl_running_stop=1, project=project
        )
    )
    assert (await client.quota(project)).usage.sandboxes == 1
    # The idle reaper stops it. The charge is released as the stop begins (before the
    # kill, when no command can reach it any more); the state turns terminal after.
    for _ in range(200):
        if (await client.quota(project)).usage.sandboxes == 0 and (
            await sb.refresh()
        ).state.terminal:
            break
        await asyncio.sleep(0.1)
    assert (await sb.refresh()).state.terminal
    assert (await client.quota(project)).usage.sandboxes == 0
    await client.delete_project(project)


async def test_fork_children_are_charged_all_or_none(
    client: DSecClient, busybox_image: str
) -> None:
    project = "fork-" + secrets.token_hex(3)
    await client.create_project(project)
    await client.set_quota(project, max_sandboxes=2)
    sb = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64, project=project)
    )
    try:
        with pytest.raises(QuotaExceeded) as exc:
            await sb.fork(2)
        assert exc.value.details["fits"] == 1
        assert (await client.quota(project)).usage.sandboxes == 1
        (child,) = await sb.fork(1)
        assert (await client.quota(project)).usage.sandboxes == 2
        await child.stop()
        assert (await client.quota(project)).usage.sandboxes == 1
    finally:
        await sb.stop()
    assert (await client.quota(project)).usage.sandboxes == 0
    await client.delete_project(project)


def test_cli_project_principal_key_quota(platform: PlatformProcess) -> None:
    env = {**os.environ, "DSEC_URL": platform.url, "DSEC_API_KEY": platform.api_key}

    def dsec(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )

    tag = secrets.token_hex(3)
    project, agent = f"cli-{tag}", f"agent-{tag}"
    assert dsec("project", "create", project).returncode == 0
    assert dsec("project", "create", f"{project}/sub").returncode == 0
    shown = dsec("quota", "set", project, "--sandboxes", "4", "--cpu", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["limits"] == {
        "max_sandboxes": 4,
        "cpu_cores": 2.0,
        "memory_mb": None,
    }
    over = dsec("quota", "set", f"{project}/sub", "--sandboxes", "5")
    assert over.returncode == 1 and "exceeds the limit" in over.stderr
    assert "Traceback" not in over.stderr
    assert "sandboxes 0/4" in dsec("quota", "show", project).stdout
    assert dsec("principal", "create", agent, "--default-project", project).returncode == 0
    assert agent in dsec("principal", "list").stdout
    assert dsec("project", "grant", project, agent, "runtime").returncode == 0
    assert f"{agent}: runtime" in dsec("project", "show", project).stdout
    key = dsec("key", "create", agent, "--json")
    assert key.returncode == 0, key.stderr
    key_id = json.loads(key.stdout)["id"]
    assert key_id in dsec("key", "list", "--principal", agent).stdout
    assert dsec("key", "revoke", key_id).returncode == 0
    assert f"{project}/sub" in dsec("project", "list").stdout
    assert dsec("project", "delete", project).returncode == 1  # not empty
    assert dsec("project", "delete", f"{project}/sub").returncode == 0
    assert dsec("project", "delete", project).returncode == 0
