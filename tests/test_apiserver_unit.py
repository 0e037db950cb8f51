"""The HTTP layer of the apiserver: auth, validation, the error envelope, body caps.

``FakeEdge`` and ``FakeImages`` are in-memory stand-ins used ONLY to exercise the HTTP
layer (the SDK and CLI unit tests import them from here); real end-to-end tests run the
platform against crun.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import random
import secrets
import shlex
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.fields import parse_image_ref
from dsec.api.health import HealthInfo
from dsec.api.images import ImageInfo, PullResult
from dsec.api.layers import LayerRef
from dsec.api.sandbox import NetworkRules, SandboxInfo, SandboxState, SandboxStats
from dsec.api.spec import BackendKind, LayeredRunArgs, RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.apiserver import ApiLimits, ApiServices, create_app
from dsec.apiserver.errors import validation_message
from dsec.control.db import Base, make_engine, sqlite_url
from dsec.control.keys import ApiKeyRow, KeyStore, hash_key
from dsec.errors import (
    AdmissionRejected,
    FileNotFound,
    ImageNotFound,
    InvalidArgument,
    RegistryError,
    SandboxNotFound,
    SandboxNotRunning,
    Unauthenticated,
    Unsupported,
)
from dsec.images.oci.auth import Credentials
from dsec.images.service import ArchiveFormat, Progress, Recipe

KEY = "dsk_test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- fakes (HTTP-layer tests only) ---------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


class FakeImages:
    """An in-memory ImageService: enough to test routes and the SDK's uploads."""

    def __init__(self, refs: tuple[str, ...] = ("busybox:latest",)) -> None:
        self.images: dict[str, ImageInfo] = {}
        self.imported: dict[str, bytes] = {}
        self.builds = 0
        for ref in refs:
            self._add(ref, 1234)

    def _add(self, ref: str, size: int) -> ImageInfo:
        name, tag = parse_image_ref(ref)
        info = ImageInfo(
            name=name,
            tag=tag,
            digest="sha256:" + secrets.token_hex(32),
            layers=["sha256:" + secrets.token_hex(32)],
            size_bytes=size,
            created_at=_now(),
        )
        self.images[f"{name}:{tag}"] = info
        return info

    async def resolve(self, ref: str) -> ImageInfo:
        name, tag = parse_image_ref(ref)
        try:
            return self.images[f"{name}:{tag}"]
        except KeyError:
            raise ImageNotFound(f"no image {ref!r}; known: {sorted(self.images)}") from None

    async def compose(self, spec: LayeredRunArgs) -> ImageInfo:
        return await self.resolve(spec.image_ref)

    async def ensure(self, ref: str) -> ImageInfo:
        return await self.resolve(ref)

    async def pull(
        self, ref: str, *, credentials: Credentials | None = None, streaming: bool = True
    ) -> PullResult:
        raise RegistryError("the fake image service reaches no registry")

    async def layer_digest(self, ref: LayerRef) -> tuple[str, int]:
        raise ImageNotFound(f"no layer {ref} in the fake image service")

    async def list(self) -> list[ImageInfo]:
        return list(self.images.values())

    async def remove(self, ref: str) -> ImageInfo:
        info = await self.resolve(ref)
        del self.images[info.ref]
        return info

    async def import_directory(
        self, ref: str, path: Path, *, progress: Progress | None = None
    ) -> ImageInfo:
        return self._add(ref, 0)

    async def add_vm_blob(
        self, chunks: AsyncIterator[bytes], *, progress: Progress | None = None
    ) -> tuple[str, int]:
        raise Unsupported("the fake image service keeps no VM images")

    async def register_layers(
        self, ref: str, layers: builtins.list[str], config: dict[str, object]
    ) -> ImageInfo:
        raise Unsupported("the fake image service keeps no layers")

    async def register_vm(
        self,
        ref: str,
        disk: str,
        *,
        kernel: str | None = None,
        initrd: str | None = None,
        cmdline: str | None = None,
    ) -> ImageInfo:
        raise Unsupported("the fake image service keeps no VM images")

    async def import_archive(
        self,
        ref: str,
        chunks: AsyncIterator[bytes],
        *,
        fmt: ArchiveFormat = "auto",
        progress: Progress | None = None,
    ) -> ImageInfo:
        data = bytearray()
        async for chunk in chunks:
            data += chunk
        if not data:
            raise InvalidArgument("empty archive")
        self.imported[ref] = bytes(data)
        return self._add(ref, len(data))

    async def build(
        self,
        recipe: Recipe,
        *,
        ref: str | None = None,
        rebuild: bool = False,
        progress: Progress | None = None,
    ) -> ImageInfo:
        self.builds += 1
        default = {"busybox": "busybox:latest", "debian-python": "debian-python:bookworm"}
        target = ref or default[recipe]
        if not rebuild and target in self.images:
            return self.images[target]
        return self._add(target, 4321)

    def layer_path(self, digest: str) -> Path:
        return Path("/nonexistent") / digest


class FakeEdge:
    """An in-memory EdgeAPI with a toy shell: `echo`, `exit N`, `sleep S`, `cat`, `fail`."""

    edge_id = "e0"

    def __init__(self, images: FakeImages, capacity: int = 1000) -> None:
        self.images = images
        self.capacity = capacity
        self.boxes: dict[str, SandboxInfo] = {}
        self.files: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.execs: list[ExecRequest] = []
        self.crash_on_get = False

    def _running(self) -> int:
        return sum(1 for b in self.boxes.values() if b.state is SandboxState.RUNNING)

    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        await self.images.resolve(spec.image_ref)
        if self._running() >= self.capacity:
            raise AdmissionRejected("edge e0 is full", capacity=self.capacity)
        now = _now()
        info = SandboxInfo(
            id=f"e0-{secrets.token_hex(8)}",
            backend=BackendKind(spec.backend),
            state=SandboxState.RUNNING,
            image=spec.image_ref,
            labels=spec.labels,
            created_at=now,
            updated_at=now,
            edge="e0",
            spec=spec,
        )
        self.boxes[info.id] = info
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        if self.crash_on_get:
            raise RuntimeError("secret internal detail")
        try:
            return self.boxes[sandbox_id]
        except KeyError:
            raise SandboxNotFound(f"no sandbox {sandbox_id}") from None

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> list[SandboxInfo]:
        return [
            b
            for b in self.boxes.values()
            if (states is None or b.state in states)
            and all(b.labels.get(k) == v for k, v in (labels or {}).items())
        ]

    async def stop(self, sandbox_id: str, *, reason: str = "stopped by request") -> SandboxInfo:
        info = await self.get(sandbox_id)
        if not info.state.terminal:
            info = info.model_copy(
                update={"state": SandboxState.STOPPED, "reason": reason, "updated_at": _now()}
            )
            self.boxes[sandbox_id] = info
        return info

    async def _live(self, sandbox_id: str) -> SandboxInfo:
        info = await self.get(sandbox_id)
        if info.state is not SandboxState.RUNNING:
            raise SandboxNotRunning(f"sandbox {sandbox_id} is {info.state.value}")
        return info

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        await self._live(sandbox_id)
        self.execs.append(req)
        argv = shlex.split(req.command) if isinstance(req.command, str) else req.command
        out, err, code = "", "", 0
        if argv[0] == "echo":
            out = " ".join(argv[1:]) + "\n"
        elif argv[0] == "exit":
            code = int(argv[1])
        elif argv[0] == "sleep":
            await asyncio.sleep(float(argv[1]))
        elif argv[0] == "cat":
            out = req.stdin or ""
        elif argv[0] == "env":
            out = "".join(f"{k}={v}\n" for k, v in sorted(req.env.items()))
        elif argv[0] == "uname":
            out = "Linux fake 6.1.0 x86_64 GNU/Linux\n"
        elif argv[0] == "python3":
            out = "3.11.2 4242\n"
        else:
            err, code = f"sh: {argv[0]}: not found\n", 127
        return ExecResult(exit_code=code, stdout=out, stderr=err, duration=0.001)

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int) -> bytes:
        await self._live(sandbox_id)
        try:
            return self.files[(sandbox_id, path)][0]
        except KeyError:
            raise FileNotFound(f"no such file: {path}") from None

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        raise Unsupported("the fake edge has no verifier")

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        raise Unsupported("the fake edge has no network")

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        trajectory: TrajectoryRef | None = None,
    ) -> None:
        await self._live(sandbox_id)
        self.files[(sandbox_id, path)] = (data, mode)

    async def health(self) -> HealthInfo:
        return HealthInfo(
            version="test", edge="e0", sandboxes_running=self._running(), capacity=self.capacity
        )

    async def stats(self, sandbox_id: str | None = None) -> builtins.list[SandboxStats]:
        return []


async def make_keystore(db: Path) -> tuple[KeyStore, AsyncEngine]:
    engine = make_engine(sqlite_url(db))
    async with engine.begin() as conn:
        await conn.run_sync(
            Base.metadata.create_all, tables=[Base.metadata.tables[ApiKeyRow.__tablename__]]
        )
    keys = KeyStore(engine)
    await keys.ensure(KEY)
    return keys, engine


async def make_fake_app(
    db: Path, limits: ApiLimits | None = None
) -> tuple[FastAPI, FakeEdge, AsyncEngine]:
    keys, engine = await make_keystore(db)
    edge = FakeEdge(FakeImages())
    services = ApiServices(edge=edge, keys=keys, images=edge.images, limits=limits or ApiLimits())
    return create_app(services), edge, engine


# ---- fixtures --------------------------------------------------------------------------

SMALL = ApiLimits(max_json_bytes=64 * 1024, max_file_bytes=1024, max_import_bytes=4096)


class Api:
    def __init__(self, app: FastAPI, edge: FakeEdge, http: httpx.AsyncClient) -> None:
        self.app, self.edge, self.http = app, edge, http

    async def create(self, **spec: Any) -> dict[str, Any]:
        spec.setdefault("container_image", "busybox")
        r = await self.http.post("/v1/sandboxes", json={"spec": spec}, headers=AUTH)
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    app, edge, engine = await make_fake_app(tmp_path / "keys.db", SMALL)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield Api(app, edge, http)
    await engine.dispose()


def assert_envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["details"], dict)
    details: dict[str, Any] = err
    return details


# ---- health, auth ----------------------------------------------------------------------


async def test_health_needs_no_key(api: Api) -> None:
    r = await api.http.get("/v1/health")
    assert r.status_code == 200
    assert HealthInfo.model_validate(r.json()).edge == "e0"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic " + KEY},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer " + "k" * 5000},
    ],
)
async def test_missing_or_bad_key_is_401(api: Api, headers: dict[str, str]) -> None:
    for method, path in [
        ("GET", "/v1/sandboxes"),
        ("POST", "/v1/sandboxes"),
        ("GET", "/v1/images"),
        ("GET", "/v1/sandboxes/e0-0123456789abcdef"),
        ("PUT", "/v1/images/import?ref=a:b"),
    ]:
        r = await api.http.request(method, path, headers=headers)
        assert_envelope(r, 401, "unauthenticated")
        assert r.headers["www-authenticate"] == "Bearer"


async def test_missing_key_message_says_what_to_do(api: Api) -> None:
    r = await api.http.get("/v1/sandboxes")
    assert "Authorization: Bearer" in r.json()["error"]["message"]


async def test_openapi_and_docs_are_served(api: Api) -> None:
    r = await api.http.get("/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    for path in [
        "/v1/health",
        "/v1/sandboxes",
        "/v1/sandboxes/{sandbox_id}",
        "/v1/sandboxes/{sandbox_id}/exec",
        "/v1/sandboxes/{sandbox_id}/files",
        "/v1/images",
        "/v1/images/build",
        "/v1/images/import",
        "/v1/images/pull",
        "/v1/images/{ref}",
    ]:
        assert path in paths, sorted(paths)
    assert (await api.http.get("/docs")).status_code == 200


# ---- sandboxes -------------------------------------------------------------------------


async def test_create_get_list_exec_stop(api: Api) -> None:
    sb = await api.create(labels={"job": "a"}, memory_limit_mb=256)
    sid = sb["id"]
    assert sb["state"] == "running" and sb["spec"]["memory_limit_mb"] == 256

    r = await api.http.get(f"/v1/sandboxes/{sid}", headers=AUTH)
    assert r.json()["id"] == sid

    r = await api.http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": "echo hello world"}, headers=AUTH
    )
    assert r.status_code == 200
    assert ExecResult.model_validate(r.json()).stdout == "hello world\n"

    r = await api.http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": ["exit", "3"]}, headers=AUTH
    )
    assert r.json()["exit_code"] == 3

    r = await api.http.delete(f"/v1/sandboxes/{sid}", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    r = await api.http.delete(f"/v1/sandboxes/{sid}", headers=AUTH)
    assert r.status_code == 200, "stop is idempotent"

    r = await api.http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "echo"}, headers=AUTH)
    assert_envelope(r, 409, "sandbox_not_running")


async def test_list_defaults_to_live_sandboxes_and_filters(api: Api) -> None:
    a = await api.create(labels={"job": "a", "rank": "0"})
    b = await api.create(labels={"job": "b"})
    await api.http.delete(f"/v1/sandboxes/{b['id']}", headers=AUTH)

    async def ids(query: str) -> set[str]:
        r = await api.http.get(f"/v1/sandboxes{query}", headers=AUTH)
        assert r.status_code == 200, r.text
        return {x["id"] for x in r.json()}

    assert await ids("") == {a["id"]}
    assert await ids("?state=stopped") == {b["id"]}
    assert await ids("?state=stopped&state=running") == {a["id"], b["id"]}
    assert await ids("?label=job=a") == {a["id"]}
    assert await ids("?label=job=a&label=rank=1") == set()
    assert await ids("?label=job=b") == set()
    assert await ids("?label=job=b&state=stopped") == {b["id"]}


@pytest.mark.parametrize("query", ["?label=nokey", "?label==v", "?state=zombie", "?label=%00=1"])
async def test_list_rejects_bad_selectors(api: Api, query: str) -> None:
    r = await api.http.get(f"/v1/sandboxes{query}", headers=AUTH)
    body = assert_envelope(r, 422, "invalid_argument")
    assert "query." in body["message"]


@pytest.mark.parametrize(
    "sid", ["nope", "E0-0123456789ABCDEF", "e0-0123", "e0-0123456789abcdef0", "..", "e0_x"]
)
async def test_malformed_sandbox_id_is_404_before_the_edge(api: Api, sid: str) -> None:
    api.edge.crash_on_get = True  # the edge must not even be asked
    for method, suffix in [("GET", ""), ("DELETE", ""), ("GET", "/files?path=/a")]:
        r = await api.http.request(method, f"/v1/sandboxes/{sid}{suffix}", headers=AUTH)
        if r.status_code == 404 and r.json()["error"]["code"] == "not_found":
            continue  # '..' is resolved by the URL layer into another (unknown) route
        assert_envelope(r, 404, "sandbox_not_found")


async def test_unknown_sandbox_is_404(api: Api) -> None:
    r = await api.http.get("/v1/sandboxes/e0-0123456789abcdef", headers=AUTH)
    assert_envelope(r, 404, "sandbox_not_found")


async def test_validation_errors_name_the_field(api: Api) -> None:
    r = await api.http.post(
        "/v1/sandboxes",
        json={"spec": {"container_image": "busybox", "memory_limit_mb": 1}},
        headers=AUTH,
    )
    body = assert_envelope(r, 422, "invalid_argument")
    assert "spec.memory_limit_mb" in body["message"]
    assert body["details"]["errors"][0]["loc"] == ["body", "spec", "memory_limit_mb"]

    r = await api.http.post(
        "/v1/sandboxes",
        json={"spec": {"container_image": "busybox", "memory_limit": 1}},
        headers=AUTH,
    )
    assert "memory_limit" in assert_envelope(r, 422, "invalid_argument")["message"]

    r = await api.http.post(
        "/v1/sandboxes", content=b'{"spec": ', headers={**AUTH, "content-type": "application/json"}
    )
    assert "malformed JSON" in assert_envelope(r, 422, "invalid_argument")["message"]

    r = await api.http.post("/v1/sandboxes", headers=AUTH)
    assert "body" in assert_envelope(r, 422, "invalid_argument")["message"]


async def test_admission_and_missing_image_are_typed(api: Api) -> None:
    r = await api.http.post(
        "/v1/sandboxes", json={"spec": {"container_image": "nothere:1"}}, headers=AUTH
    )
    assert_envelope(r, 404, "image_not_found")
    api.edge.capacity = 0
    r = await api.http.post(
        "/v1/sandboxes", json={"spec": {"container_image": "busybox"}}, headers=AUTH
    )
    assert_envelope(r, 503, "admission_rejected")


async def test_unexpected_exception_is_500_without_traceback(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    sb = await api.create()
    api.edge.crash_on_get = True
    r = await api.http.get(f"/v1/sandboxes/{sb['id']}", headers=AUTH)
    body = assert_envelope(r, 500, "internal")
    assert "secret internal detail" not in r.text and "Traceback" not in r.text
    assert body["details"] == {}
    assert "secret internal detail" in caplog.text, "logged server side"


async def test_unknown_route_and_wrong_method_use_the_envelope(api: Api) -> None:
    assert_envelope(await api.http.get("/v2/nothing"), 404, "not_found")
    assert_envelope(await api.http.get("/"), 404, "not_found")
    r = await api.http.patch("/v1/sandboxes", headers=AUTH)
    assert_envelope(r, 405, "method_not_allowed")
    assert "POST" in r.headers["allow"]
    assert_envelope(await api.http.post("/v1/health"), 405, "method_not_allowed")


# ---- files -----------------------------------------------------------------------------


async def test_files_roundtrip_mode_and_caps(api: Api) -> None:
    sid = (await api.create())["id"]
    url = f"/v1/sandboxes/{sid}/files"
    r = await api.http.put(
        url, params={"path": "/tmp/a", "mode": "0755"}, content=b"\x00\xff", headers=AUTH
    )
    assert r.status_code == 204 and r.content == b""
    assert api.edge.files[(sid, "/tmp/a")] == (b"\x00\xff", 0o755)
    r = await api.http.get(url, params={"path": "/tmp/a"}, headers=AUTH)
    assert r.content == b"\x00\xff"
    assert r.headers["content-type"] == "application/octet-stream"

    assert_envelope(
        await api.http.get(url, params={"path": "/nope"}, headers=AUTH), 404, "file_not_found"
    )
    for bad in ["relative", "/a\x00b", "", "/" + "a" * 5000]:
        r = await api.http.get(url, params={"path": bad}, headers=AUTH)
        assert_envelope(r, 422, "invalid_argument")
    assert_envelope(await api.http.get(url, headers=AUTH), 422, "invalid_argument")
    for mode in ["999", "rw", "12345", "", "-1"]:
        r = await api.http.put(url, params={"path": "/a", "mode": mode}, content=b"x", headers=AUTH)
        assert_envelope(r, 422, "invalid_argument")

    # Over the cap: declared length and chunked streaming both fail with a typed 413.
    r = await api.http.put(url, params={"path": "/big"}, content=b"x" * 2000, headers=AUTH)
    assert "1 KiB" in assert_envelope(r, 413, "payload_too_large")["message"]

    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b"y" * 500

    async def achunks() -> AsyncIterator[bytes]:
        for c in chunks():
            yield c

    r = await api.http.put(url, params={"path": "/big"}, content=achunks(), headers=AUTH)
    assert_envelope(r, 413, "payload_too_large")
    assert (sid, "/big") not in api.edge.files


async def test_json_body_cap(api: Api) -> None:
    sid = (await api.create())["id"]
    r = await api.http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": "cat", "stdin": "z" * 100_000}, headers=AUTH
    )
    assert_envelope(r, 413, "payload_too_large")


# ---- images ----------------------------------------------------------------------------


async def test_images_routes(api: Api) -> None:
    r = await api.http.get("/v1/images", headers=AUTH)
    assert [i["name"] for i in r.json()] == ["busybox"]

    r = await api.http.post("/v1/images/build", json={"recipe": "debian-python"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["tag"] == "bookworm"
    r = await api.http.post("/v1/images/build", json={"recipe": "centos"}, headers=AUTH)
    assert "recipe" in assert_envelope(r, 422, "invalid_argument")["message"]
    r = await api.http.post("/v1/images/pull", json={"ref": "Bad:Ref:x"}, headers=AUTH)
    assert "image reference" in assert_envelope(r, 422, "invalid_argument")["message"]
    r = await api.http.post(
        "/v1/images/pull", json={"ref": "127.0.0.1:1/a:b", "username": "u"}, headers=AUTH
    )
    assert "password" in assert_envelope(r, 422, "invalid_argument")["message"]

    r = await api.http.put(
        "/v1/images/import",
        params={"ref": "reg.io/team/app:v1", "format": "tar"},
        content=b"tarbytes",
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert api.edge.images.imported["reg.io/team/app:v1"] == b"tarbytes"

    r = await api.http.get("/v1/images/reg.io/team/app:v1", headers=AUTH)
    assert r.status_code == 200 and r.json()["name"] == "reg.io/team/app"
    r = await api.http.delete("/v1/images/reg.io/team/app:v1", headers=AUTH)
    assert r.status_code == 200
    r = await api.http.get("/v1/images/reg.io/team/app:v1", headers=AUTH)
    assert_envelope(r, 404, "image_not_found")

    for bad in ["UPPER:1", "a:b:c", "a/%2E%2E/b:1", "a//b"]:
        r = await api.http.get(f"/v1/images/{bad}", headers=AUTH)
        assert_envelope(r, 422, "invalid_argument")
    r = await api.http.put(
        "/v1/images/import", params={"ref": "x:1", "format": "zip"}, content=b"a", headers=AUTH
    )
    assert "format" in assert_envelope(r, 422, "invalid_argument")["message"]
    r = await api.http.put("/v1/images/import", content=b"a", headers=AUTH)
    assert "ref" in assert_envelope(r, 422, "invalid_argument")["message"]
    r = await api.http.put(
        "/v1/images/import", params={"ref": "big:1"}, content=b"a" * 5000, headers=AUTH
    )
    assert_envelope(r, 413, "payload_too_large")


# ---- fuzz ----------------------------------------------------------------------------------

_ROUTES = [
    ("GET", "/v1/health"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{sid}"),
    ("DELETE", "/v1/sandboxes/{sid}"),
    ("POST", "/v1/sandboxes/{sid}/exec"),
    ("GET", "/v1/sandboxes/{sid}/files"),
    ("PUT", "/v1/sandboxes/{sid}/files"),
    ("GET", "/v1/images"),
    ("POST", "/v1/images/build"),
    ("PUT", "/v1/images/import"),
    ("GET", "/v1/images/busybox:latest"),
    ("DELETE", "/v1/images/nothere:1"),
]
_ODD_PATHS = [
    "/v1/sandboxes/%00",
    "/v1/sandboxes/{sid}/../..",
    "/v1/%ff%fe",
    "/v1/images/" + "a" * 300,
    "/v1/images/a/%2e%2e/b",
]
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def _garbage_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**70, 1e308, -0.0, 3.5])
    if kind == 3:
        return "".join(chr(rng.randrange(0, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.choice(["busybox", "echo hi", "/tmp", "root", "", "\x00"])
    if kind == 5:
        return rng.randrange(-5, 100_000)
    if kind == 6:
        return [_garbage_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = [
        "spec",
        "command",
        "timeout",
        "env",
        "container_image",
        "memory_limit_mb",
        "labels",
        "recipe",
        "stdin",
        "user",
        "workdir",
        "x" * 3,
    ]
    out: dict[str, Any] = {}
    for _ in range(rng.randrange(5)):
        out[rng.choice(keys)] = _garbage_json(rng, depth + 1)
    return out


def _garbage_body(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    kind = rng.randrange(5)
    if kind == 0:
        return b"", {}
    if kind == 1:
        return rng.randbytes(rng.randrange(1, 200)), {}
    if kind == 2:
        return json.dumps(_garbage_json(rng)).encode(), {"content-type": "application/json"}
    if kind == 3:
        raw = json.dumps(_garbage_json(rng)).encode()
        return raw[: rng.randrange(len(raw) + 1)], {"content-type": "application/json"}
    ct = rng.choice(
        [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
            "application/json; charset=latin-1",
            "application/merge+json",
            "\x7f",
        ]
    )
    return rng.randbytes(rng.randrange(50)), {"content-type": ct}


async def test_fuzzed_requests_never_500(api: Api) -> None:
    sid = (await api.create())["id"]
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    for _ in range(400):
        method, path = rng.choice(_ROUTES)
        if rng.random() < 0.15:
            method = rng.choice(_METHODS)
        if rng.random() < 0.1:
            path = rng.choice(_ODD_PATHS)
        path = path.format(sid=rng.choice([sid, sid, "e0-ffffffffffffffff", "x"]))
        query = rng.choice(
            [
                "",
                "?path=/etc/passwd",
                "?path=rel",
                "?label=a=b&state=running",
                "?state=%00",
                "?mode=777&path=/x",
                "?ref=busybox:1&format=oci",
                "?ref=%ff",
                "?" + "a=b&" * 50,
            ]
        )
        body, headers = _garbage_body(rng)
        if rng.random() < 0.85:
            headers.update(AUTH)
        if rng.random() < 0.1:
            headers["content-length"] = str(rng.choice([0, 10**12, len(body)]))
        try:
            r = await api.http.request(method, path + query, content=body, headers=headers)
        except httpx.HTTPError:
            continue  # a content-length the client itself refuses to send
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500 or r.json()["error"]["code"] == "admission_rejected", (
            path,
            query,
            r.text,
        )
        if r.status_code >= 400 and r.request.method != "HEAD":
            assert "error" in r.json(), r.text
    assert statuses.get(422, 0) > 20 and statuses.get(401, 0) > 10, statuses


async def test_fuzzed_exec_bodies_reach_the_edge_only_when_valid(api: Api) -> None:
    sid = (await api.create())["id"]
    rng = random.Random(99)
    for _ in range(200):
        payload = _garbage_json(rng)
        if rng.random() < 0.3:
            payload = {"command": _garbage_json(rng), **({"env": _garbage_json(rng)})}
        r = await api.http.post(f"/v1/sandboxes/{sid}/exec", json=payload, headers=AUTH)
        assert r.status_code in (200, 422), r.text
    for req in api.edge.execs:
        ExecRequest.model_validate(req.model_dump())


def test_validation_message_is_readable() -> None:
    msg = validation_message(
        [
            {"loc": ("body", "spec", "cpu_cores_limit"), "msg": "Input should be > 0", "type": "x"},
            {"loc": ("query", "path"), "msg": "Field required", "type": "missing"},
        ]
    )
    assert msg == "body.spec.cpu_cores_limit: Input should be > 0; query.path: Field required"


# ---- KeyStore --------------------------------------------------------------------------------


async def test_keystore_create_verify_revoke_and_cache(tmp_path: Path) -> None:
    keys, engine = await make_keystore(tmp_path / "k.db")
    queries: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: queries.append(a[2]))
    try:
        await keys.ensure(KEY)  # idempotent
        await keys.ensure(KEY, "admin")
        key = await keys.create("alice")
        assert key.startswith("dsk_") and len(key) > 30
        assert await keys.verify(key) == "alice"

        queries.clear()
        for _ in range(100):
            assert await keys.verify(KEY) == "admin"
        assert queries == [], "verified keys are served from memory"

        with pytest.raises(Unauthenticated):
            await keys.verify("dsk_unknown")
        queries.clear()
        with pytest.raises(Unauthenticated):
            await keys.verify("dsk_unknown")
        assert queries == [], "unknown keys are briefly cached too"

        assert await keys.revoke(key) is True
        assert await keys.revoke(key) is False
        with pytest.raises(Unauthenticated):
            await keys.verify(key)

        # Only the hash is stored.
        async with engine.connect() as conn:
            rows = (await conn.exec_driver_sql("SELECT key_hash, principal FROM api_keys")).all()
        assert (hash_key(KEY), "admin") in [tuple(r) for r in rows]
        assert all(KEY not in r[0] for r in rows)

        # A fresh store (another process) sees the keys; ensure() may re-assign a principal.
        other = KeyStore(engine)
        assert await other.verify(KEY) == "admin"
        await other.ensure(KEY, "root-ops")
        assert await other.verify(KEY) == "root-ops"
        with pytest.raises(InvalidArgument):
            await keys.ensure("has space")
        with pytest.raises(Unauthenticated):
            await keys.verify("")
    finally:
        await engine.dispose()


async def test_keystore_concurrent_ensure(tmp_path: Path) -> None:
    _, engine = await make_keystore(tmp_path / "k.db")
    try:
        fresh = [KeyStore(engine) for _ in range(8)]
        await asyncio.gather(*(k.ensure("dsk_same", "bob") for k in fresh))
        assert await KeyStore(engine).verify("dsk_same") == "bob"
    finally:
        await engine.dispose()
