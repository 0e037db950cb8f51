"""What the composition roots hand to create_app decides what the app serves.

The roots (dsec.roots) are exercised for real by the platform and cluster tests; these
check the decisions that moved out of create_app into ApiServices: the RL routes
follow an explicit ``rl`` edge (no longer ``hasattr(edge, "pause_job")``), a cluster
apiserver's batch limits reach the app's batch runner, and the dashboard is served
wherever an audit log (one node's or a cluster's) is, its jobs page offering pause and
resume only where the RL routes are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response

from dsec.api.rl import ForkRequest, ForkResult, JobPauseReport, JobResumeReport, PackedEnv
from dsec.api.sandbox import SandboxInfo
from dsec.apiserver import ApiServices, BatchLimits, create_app
from dsec.control.db import make_engine, migrate, sqlite_url
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.errors import NotFound
from dsec.roots.apiserver import CLUSTER_BATCH_PARALLELISM, cluster_batch_limits
from dsec.security.audit import Filters
from tests.test_apiserver_unit import FakeEdge, FakeImages

PAUSE = "/v1/jobs/{job_id}/pause"


class NoJobs:
    """An RL edge that knows no job or sandbox: enough for the routes to exist."""

    async def pause_job(self, job_id: str) -> JobPauseReport:
        raise NotFound(f"no job {job_id}")

    async def resume_job(self, job_id: str) -> JobResumeReport:
        raise NotFound(f"no job {job_id}")

    async def pack_diff(self, sandbox_id: str, name: str, version: str) -> PackedEnv:
        raise NotFound(f"no sandbox {sandbox_id}")

    async def fork(self, sandbox_id: str, req: ForkRequest) -> ForkResult:
        raise NotFound(f"no sandbox {sandbox_id}")

    async def get(self, sandbox_id: str) -> SandboxInfo:
        raise NotFound(f"no sandbox {sandbox_id}")


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[KeyStore, RoleStore]]:
    engine = make_engine(sqlite_url(tmp_path / "control.db"))
    await migrate(engine)
    iam = IAM(engine)
    await iam.ensure_bootstrap()
    try:
        yield KeyStore(engine), RoleStore(iam)
    finally:
        await iam.close()
        await engine.dispose()


async def test_rl_routes_follow_the_rl_edge(stores: tuple[KeyStore, RoleStore]) -> None:
    keys, roles = stores
    edge = FakeEdge(FakeImages())
    without = create_app(ApiServices(edge=edge, keys=keys, roles=roles))
    assert PAUSE not in without.openapi()["paths"]
    with_rl = create_app(ApiServices(edge=edge, keys=keys, roles=roles, rl=NoJobs()))
    assert PAUSE in with_rl.openapi()["paths"]
    no_roles = create_app(ApiServices(edge=edge, keys=keys, rl=NoJobs()))
    assert PAUSE not in no_roles.openapi()["paths"]


async def test_batch_limits_reach_the_runner(
    stores: tuple[KeyStore, RoleStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, _ = stores
    edge = FakeEdge(FakeImages())
    monkeypatch.delenv("DSEC_BATCH_PARALLELISM", raising=False)
    monkeypatch.delenv("DSEC_BATCH_MAX_IN_FLIGHT", raising=False)
    limits = cluster_batch_limits()
    assert limits == BatchLimits(CLUSTER_BATCH_PARALLELISM, 4 * CLUSTER_BATCH_PARALLELISM)
    app = create_app(ApiServices(edge=edge, keys=keys, batches=limits))
    assert app.state.batches.default_parallelism == CLUSTER_BATCH_PARALLELISM
    assert app.state.batches.max_in_flight == 4 * CLUSTER_BATCH_PARALLELISM
    # The operator's setting wins: the runner's own defaults read it.
    monkeypatch.setenv("DSEC_BATCH_PARALLELISM", "3")
    assert cluster_batch_limits() == BatchLimits()
    app = create_app(ApiServices(edge=edge, keys=keys, batches=cluster_batch_limits()))
    assert app.state.batches.default_parallelism == 3
    assert app.state.batches.max_in_flight == 64


class NoAudit:
    """An audit kept elsewhere (a cluster's, dsec.apiserver.security.AuditQuery), empty."""

    async def answer(self, params: QueryParams, filters: Filters, events: bool) -> Response:
        return Response("[]", media_type="application/json")

    async def follow(self, request: Request, filters: Filters) -> Response:
        return Response("", media_type="text/event-stream")


async def test_the_dashboard_follows_the_audit_and_its_jobs_page_the_rl_edge(
    stores: tuple[KeyStore, RoleStore],
) -> None:
    keys, roles = stores
    await keys.ensure("dsk_ui_test", principal="admin")
    edge = FakeEdge(FakeImages())

    async def session(services: ApiServices) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(services))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
            login = await h.get("/ui", params={"api_key": "dsk_ui_test"})
            if login.status_code == 404:
                return login
            assert login.status_code == 303
            return await h.get("/ui/session")

    assert (await session(ApiServices(edge=edge, keys=keys))).status_code == 404
    cluster = await session(ApiServices(edge=edge, keys=keys, audit=NoAudit(), roles=roles))
    assert cluster.status_code == 200 and cluster.json()["job_control"] is False
    with_rl = ApiServices(edge=edge, keys=keys, audit=NoAudit(), roles=roles, rl=NoJobs())
    assert (await session(with_rl)).json()["job_control"] is True
