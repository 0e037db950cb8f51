"""Tenant isolation of sandboxes (dsec.apiserver.sandboxaccess) on the session platform.

A second tenant, with ``runtime`` on its own project only, attacks the admin's sandbox
by every route with a ``{sandbox_id}`` parameter, found by walking the app's routes (a
route added later without the check fails here), then by lists, stats, the audit log,
the multiplexed WebSocket and the SDKs. Another tenant's sandbox must look exactly like
an id that does not exist (404); the tenant's own sandbox keeps working.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from unittest.mock import MagicMock

import httpx
import pytest
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute
from starlette.routing import BaseRoute
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from dsec import DSecSyncClient, NotFound
from dsec.api.iam import PrincipalCreate, Role
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import BackendKind, DSecContainerRunArgs
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.datapath import DataAuth
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.services import ApiServices
from dsec.control.db import make_engine, migrate, sqlite_url
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.errors import PermissionDenied, SandboxNotFound
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.timeout(180)


@dataclass
class Tenants:
    url: str
    admin_key: str
    key: str  # the second tenant's
    theirs: str  # the admin's sandbox (project "default")
    mine: str  # the tenant's own sandbox
    label: str  # a label on the admin's sandbox


@pytest.fixture(scope="module")
def tenants(platform: PlatformProcess, busybox_image: str) -> Iterator[Tenants]:
    tag = secrets.token_hex(3)
    with DSecSyncClient(platform.url, platform.api_key) as admin:
        admin.create_project(f"sa-{tag}")
        admin.create_principal(f"tenant-{tag}", default_project=f"sa-{tag}")
        admin.grant(f"tenant-{tag}", "runtime", project=f"sa-{tag}")
        key = admin.create_key(f"tenant-{tag}").key
        spec = DSecContainerRunArgs(
            container_image=busybox_image, memory_limit_mb=64, labels={"owner": f"a{tag}"}
        )
        theirs = admin.run_sandbox(spec)
        try:
            with DSecSyncClient(platform.url, key) as tenant:
                mine = tenant.run_sandbox(
                    DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64)
                )
                try:
                    yield Tenants(platform.url, platform.api_key, key, theirs.id, mine.id, tag)
                finally:
                    mine.stop()
        finally:
            theirs.stop()


#: Routes with a sandbox id that need no check: the dashboard's page shells, the same
#: static HTML for any id behind the session cookie (their data comes from checked
#: routes).
STATIC_PAGES = ("/ui/sandbox/{sandbox_id}", "/ui/desktop/{sandbox_id}")


def _walk(routes: Iterable[BaseRoute]) -> Iterator[tuple[str, BaseRoute]]:
    """(full path, route) of every route, included routers flattened."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is not None:  # an included router (FastAPI >= 0.160)
            for ctx in contexts():
                yield ctx.path, ctx.original_route
        else:
            yield getattr(route, "path", ""), route


def _app() -> FastAPI:
    """The app with every route family switched on. The services are inert
    placeholders: only the routes are read, nothing is called."""
    return create_app(
        ApiServices(
            edge=MagicMock(),
            keys=MagicMock(),
            images=MagicMock(),
            dataplane=MagicMock(),
            layers=MagicMock(),
            audit=MagicMock(),
            fncall=MagicMock(),
            trajectory=MagicMock(),
            roles=MagicMock(),
            rl=MagicMock(),
            iam=MagicMock(),
            metrics=MagicMock(),
            rollouts=MagicMock(),
        )
    )


def sandbox_routes() -> list[tuple[str, str]]:
    """(method, path) of every route with a ``{sandbox_id}`` parameter, HTTP and
    WebSocket ("WS"), but the static page shells."""
    found: list[tuple[str, str]] = []
    for path, route in _walk(_app().routes):
        if "{sandbox_id}" not in path or path in STATIC_PAGES:
            continue
        if isinstance(route, APIWebSocketRoute):
            found.append(("WS", path))
        elif isinstance(route, APIRoute):
            found += [(m, path) for m in sorted(route.methods or ())]
    return found


def _calls(dependant: Dependant) -> Iterator[object]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def test_every_v1_sandbox_route_depends_on_the_check() -> None:
    """Structurally: every HTTP route of our API with a sandbox id has the check as a
    dependency (SandboxAccess.runtime/.builder, or the data path's DataAuth, which
    checks a key's principal the same way), so it runs before the handler. E2B's
    routes check in their handler (dsec.compat.e2b.access) and WebSockets before the
    upgrade or first frame; both are covered by the behaviour test below."""
    missing = []
    for path, route in _walk(_app().routes):
        if not path.startswith("/v1/") or "{sandbox_id}" not in path:
            continue
        if not isinstance(route, APIRoute):
            continue
        names = {getattr(c, "__qualname__", "") for c in _calls(route.dependant)}
        checked = any(isinstance(c, DataAuth) for c in _calls(route.dependant)) or bool(
            names
            & {"SandboxAccess.__init__.<locals>.runtime", "SandboxAccess.__init__.<locals>.builder"}
        )
        if not checked:
            missing.append((sorted(route.methods or ()), path))
    assert missing == []


def test_route_walk_finds_every_family() -> None:
    """The walk itself: if it stopped seeing a family, the next test would prove less."""
    paths = {p for _, p in sandbox_routes()}
    for expected in (
        "/v1/sandboxes/{sandbox_id}",
        "/v1/sandboxes/{sandbox_id}/exec",
        "/v1/sandboxes/{sandbox_id}/files",
        "/v1/sandboxes/{sandbox_id}/token",
        "/v1/sandboxes/{sandbox_id}/fork",
        "/v1/sandboxes/{sandbox_id}/fs/list",
        "/v1/edge/sandboxes/{sandbox_id}/files",
        "/v1/edge/sandboxes/{sandbox_id}/pty",
        "/v1/edge/sandboxes/{sandbox_id}/desktop/vnc",
        "/sandboxes/{sandbox_id}",  # E2B
    ):
        assert expected in paths, expected


def _code(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return ""
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else ""


async def _ws_refusal(url: str, key: str) -> tuple[int, str]:
    """(HTTP status, error code) a WebSocket upgrade was refused or closed with."""
    try:
        ws_conn = await connect(url, additional_headers={"Authorization": f"Bearer {key}"})
    except InvalidStatus as exc:
        body = json.loads(exc.response.body or b"{}")
        return exc.response.status_code, str(body.get("error", {}).get("code"))
    async with ws_conn as ws:  # accepted first (PTY): the error comes as a frame
        reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
        return 101, str(reply.get("error", {}).get("code") or reply.get("code"))


def test_every_sandbox_route_hides_another_tenants_sandbox(tenants: Tenants) -> None:
    """Each route, with the admin's sandbox id (seen, guessed neighbours alike), answers
    the tenant 404 sandbox_not_found before reading its body: the check runs first."""
    headers = {"Authorization": f"Bearer {tenants.key}", "X-API-KEY": tenants.key}
    routes = sandbox_routes()
    with httpx.Client(base_url=tenants.url, headers=headers, timeout=60) as http:
        for method, path in routes:
            if method == "WS":
                continue
            url = path.replace("{sandbox_id}", tenants.theirs)
            r = http.request(method, url, params={"path": "/etc/passwd"}, content=b"{}")
            e2b = not path.startswith("/v1/")
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            if not e2b:  # E2B answers in its own error shape
                assert _code(r) == "sandbox_not_found", (method, path, r.text)
        # The same routes on its own sandbox are not hidden (the check lets it through).
        for method, path in (
            ("GET", "/v1/sandboxes/{sandbox_id}"),
            ("POST", "/v1/sandboxes/{sandbox_id}/token"),
        ):
            r = http.request(method, path.replace("{sandbox_id}", tenants.mine))
            assert r.status_code == 200, r.text
    ws_base = tenants.url.replace("http://", "ws://")
    for method, path in routes:
        if method != "WS":
            continue
        status, code = asyncio.run(
            _ws_refusal(ws_base + path.replace("{sandbox_id}", tenants.theirs), tenants.key)
        )
        assert code == "sandbox_not_found", (path, status, code)


def test_lists_stats_and_audit_are_the_tenants_own(tenants: Tenants) -> None:
    h = {"Authorization": f"Bearer {tenants.key}"}
    with httpx.Client(base_url=tenants.url, headers=h, timeout=60) as http:
        ids = [s["id"] for s in http.get("/v1/sandboxes").json()]
        assert tenants.mine in ids and tenants.theirs not in ids
        by_label = http.get("/v1/sandboxes", params={"label": f"owner=a{tenants.label}"}).json()
        assert by_label == []
        every = http.get(
            "/v1/sandboxes", params={"state": ["running", "stopped", "failed", "creating"]}
        ).json()
        assert tenants.theirs not in [s["id"] for s in every]
        stats = [s["id"] for s in http.get("/v1/stats").json()]
        assert tenants.mine in stats and tenants.theirs not in stats
        assert http.get("/v1/stats", params={"sandbox_id": tenants.theirs}).json() == []
        # The audit log: the whole of it is an admin's; a filter on another's is 404.
        for route in ("/v1/audit", "/v1/events", "/v1/events/stream"):
            assert http.get(route).status_code == 403, route
            r = http.get(route, params={"sandbox_id": tenants.theirs})
            assert r.status_code == 404, (route, r.text)
        own = http.get("/v1/audit", params={"sandbox_id": tenants.mine})
        assert own.status_code == 200 and own.json(), own.text
        assert all(rec["sandbox_id"] == tenants.mine for rec in own.json())
    with httpx.Client(base_url=tenants.url, timeout=60) as http:  # the admin sees all
        admin = {"Authorization": f"Bearer {tenants.admin_key}"}
        ids = [s["id"] for s in http.get("/v1/sandboxes", headers=admin).json()]
        assert {tenants.mine, tenants.theirs} <= set(ids)
        assert http.get("/v1/audit", headers=admin, params={"limit": 1}).status_code == 200


def test_multiplexed_socket_checks_every_frame(tenants: Tenants) -> None:
    """An API key opens the data-path socket, but each frame's sandbox is checked."""

    async def frame(sandbox_id: str) -> dict[str, object]:
        url = tenants.url.replace("http://", "ws://") + "/v1/edge/rpc"
        h = {"Authorization": f"Bearer {tenants.key}"}
        async with connect(url, additional_headers=h) as ws:
            msg = {"id": 1, "op": "run", "sandbox": sandbox_id, "args": {"command": "echo hi"}}
            await ws.send(json.dumps(msg))
            while True:
                raw = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(raw, str):
                    reply: dict[str, object] = json.loads(raw)
                    return reply

    theirs = asyncio.run(frame(tenants.theirs))
    assert isinstance(theirs.get("error"), dict), theirs
    assert theirs["error"]["code"] == "sandbox_not_found"  # type: ignore[index]
    mine = asyncio.run(frame(tenants.mine))
    assert "error" not in mine, mine


def test_sdk_attacks(tenants: Tenants) -> None:
    """Through the SDK: seen and guessed ids, data-path tokens, exec and files."""
    with DSecSyncClient(tenants.url, tenants.key) as tenant:
        guessed = re.sub(r"[0-9a-f]$", "0", tenants.theirs)
        for sid in {tenants.theirs, guessed}:
            with pytest.raises(NotFound):
                tenant.get(sid)
            with pytest.raises(NotFound):
                tenant.stop_sandbox(sid)
        assert [s.id for s in tenant.list_sandboxes()] == [tenants.mine]
    # Word for word what an id nobody holds gets: the message leaks nothing either.
    h = {"Authorization": f"Bearer {tenants.key}"}
    unheld = tenants.theirs.split("-")[0] + "-" + "0" * 16
    answers = [
        httpx.get(f"{tenants.url}/v1/sandboxes/{sid}", headers=h).json()["error"]
        for sid in (tenants.theirs, unheld)
    ]
    assert json.dumps(answers[0]).replace(tenants.theirs, unheld) == json.dumps(answers[1])
    assert answers[0]["code"] == "sandbox_not_found"
    with DSecSyncClient(tenants.url, tenants.key) as tenant:
        own = tenant.get(tenants.mine).info.data_path
        assert own is not None
        # its own token does not open the admin's sandbox on the data path
        h = {"Authorization": f"Bearer {own.token}"}
        r = httpx.get(
            f"{tenants.url}/v1/edge/sandboxes/{tenants.theirs}/fs/stat",
            params={"path": "/"},
            headers=h,
        )
        assert r.status_code in (401, 403, 404), r.text
    with DSecSyncClient(tenants.url, tenants.admin_key) as admin:  # untouched
        assert admin.get(tenants.theirs).state.value == "running"


def test_e2b_sdk_attacks(tenants: Tenants) -> None:
    e2b = pytest.importorskip("e2b")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", tenants.url)
        mp.setenv("E2B_SANDBOX_URL", tenants.url)
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.connect(tenants.theirs, api_key=tenants.key)
        assert e2b.Sandbox.kill(tenants.theirs, api_key=tenants.key) is False
        listed = e2b.Sandbox.list(api_key=tenants.key).next_items()
        assert tenants.theirs not in [s.sandbox_id for s in listed]


A, B, C, F = (f"e0-{c * 16}" for c in "abcf")


class _Records:
    """Sandbox records by id, counting lookups (the decision's only input besides IAM)."""

    def __init__(self, *infos: SandboxInfo) -> None:
        self.infos = {i.id: i for i in infos}
        self.lookups = 0

    async def get(self, sandbox_id: str) -> SandboxInfo:
        self.lookups += 1
        info = self.infos.get(sandbox_id)
        if info is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on edge e0")
        return info


def _info(sid: str, project: str | None) -> SandboxInfo:
    now = datetime.now(UTC)
    spec = DSecContainerRunArgs(container_image="busybox:latest", project=project)
    return SandboxInfo(
        id=sid,
        backend=BackendKind.CONTAINER,
        state=SandboxState.RUNNING,
        image="busybox:latest",
        created_at=now,
        updated_at=now,
        edge="e0",
        spec=spec,
    )


async def test_the_decision(tmp_path: Path) -> None:
    """No IAM: everything passes without a lookup. An admin of every project: no
    lookup either (unknown ids keep the edge's own answer). A tenant: 404 on another
    project's sandbox and on pre-IAM ones (the default project), 403 for pack/fork with
    only runtime; the project is read once per sandbox."""
    engine = make_engine(sqlite_url(tmp_path / "c.db"))
    await migrate(engine)
    iam = IAM(engine, cache_ttl=0.0)
    try:
        await iam.ensure_bootstrap()
        await iam.create_project("admin", "t")
        await iam.create_principal("admin", PrincipalCreate(name="bob", default_project="t"))
        await iam.grant("admin", "bob", "t", Role.RUNTIME)
        recs = _Records(
            _info(A, "t"),
            _info(B, "default"),
            _info(C, None),
        )
        auth = Authenticator(KeyStore(engine))
        off = SandboxAccess(recs, None, auth)
        assert await off.require("bob", B, Role.BUILDER) == B
        assert recs.lookups == 0
        on = SandboxAccess(recs, iam, auth)
        assert await on.require("admin", F) == F
        assert recs.lookups == 0
        assert await on.require("bob", A) == A
        assert await on.require("bob", A) == A
        assert recs.lookups == 1  # remembered
        for sid in (B, C, F):
            with pytest.raises(SandboxNotFound):
                await on.require("bob", sid)
        with pytest.raises(PermissionDenied):
            await on.require("bob", A, Role.BUILDER, "forking")
        with pytest.raises(SandboxNotFound):  # not an id at all: checked before anything
            await on.require("bob", "../etc")
        seen = await on.visible("bob", recs.infos.values())
        assert [i.id for i in seen] == [A]
    finally:
        await iam.close()
        await engine.dispose()
