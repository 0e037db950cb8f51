"""Item 7 of issue 13: idempotent creates. A client that lost the answer to a create
retries with its Idempotency-Key and gets the one sandbox the first attempt made; the
same key with another spec is a 409, a malformed key a 422; keys are per principal,
durable across a crash, and a create that failed gives its key back."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecSyncClient, SandboxState
from dsec.api.sandbox import CreateSandboxRequest
from dsec.errors import IdempotencyKeyReused, ImageNotFound, InvalidArgument
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

HEADER = "Idempotency-Key"


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        with DSecSyncClient(p.url, p.api_key) as c:
            c.build_image("busybox")
        yield p


@pytest.fixture
async def client(plat: PlatformProcess) -> AsyncIterator[DSecClient]:
    c = DSecClient(plat.url, plat.api_key)
    await c.open()
    try:
        yield c
    finally:
        # Whatever a test made (labelled with "fault"), even when it failed.
        for sb in await c.list_sandboxes(labels={"fault": "idem"}):
            with contextlib.suppress(Exception):
                await sb.stop()
        await c.close()


def _spec(tag: str, memory: int = 64) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image="busybox:latest",
        memory_limit_mb=memory,
        labels={"fault": "idem", "tag": tag},
    )


def _http(plat: PlatformProcess, key: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=plat.url, headers={"Authorization": f"Bearer {key or plat.api_key}"}
    )


def _post(
    h: httpx.Client, spec: DSecContainerRunArgs, key: str | bytes, **kw: object
) -> httpx.Response:
    body = CreateSandboxRequest(spec=spec, timeout=60).model_dump_json()
    headers = {"Content-Type": "application/json", HEADER: key}
    return h.post("/v1/sandboxes", content=body, headers=headers, **kw)  # type: ignore[arg-type]


async def _live(client: DSecClient, tag: str) -> list[str]:
    states = [SandboxState.CREATING, SandboxState.RUNNING]
    return [sb.id for sb in await client.list_sandboxes(labels={"tag": tag}, states=states)]


async def test_retry_after_the_client_gave_up_gives_one_sandbox(
    plat: PlatformProcess, client: DSecClient
) -> None:
    tag, key = secrets.token_hex(4), f"lost-{secrets.token_hex(8)}"
    with _http(plat) as h:
        # The client gives up long before the answer: the create goes on regardless.
        with pytest.raises(httpx.ReadTimeout):
            _post(h, _spec(tag), key, timeout=httpx.Timeout(5.0, read=0.001))
        # The request was sent: the server makes the sandbox, acknowledged to nobody.
        for _ in range(500):
            if await _live(client, tag):
                break
            await asyncio.sleep(0.01)
        retry = _post(h, _spec(tag), key, timeout=60)  # waits for the first one if need be
        assert retry.status_code == 200, retry.text
        assert retry.headers["Idempotent-Replayed"] == "true"
        again = _post(h, _spec(tag), key, timeout=60)
        assert again.status_code == 200 and again.json()["id"] == retry.json()["id"]
    assert await _live(client, tag) == [retry.json()["id"]]
    sb = await client.get(retry.json()["id"])
    assert (await sb.run_shell("echo one")).stdout == "one\n"


async def test_cancelled_sdk_create_is_adopted_by_its_retry(
    plat: PlatformProcess, client: DSecClient
) -> None:
    tag, key = secrets.token_hex(4), secrets.token_hex(16)
    first = asyncio.create_task(client.run_container(_spec(tag), idempotency_key=key))
    await asyncio.sleep(0.005)  # mid-flight
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    sb = await client.run_container(_spec(tag), idempotency_key=key)
    assert sb.info.state is SandboxState.RUNNING
    # concurrent retries, and the sync twin: all the same sandbox
    more = await asyncio.gather(
        *(client.run_container(_spec(tag), idempotency_key=key) for _ in range(4))
    )
    assert {m.id for m in more} == {sb.id}

    def sync_retry() -> str:
        with DSecSyncClient(plat.url, plat.api_key) as c:
            return c.run_container(_spec(tag), idempotency_key=key).id

    assert await asyncio.to_thread(sync_retry) == sb.id
    assert await _live(client, tag) == [sb.id]
    await sb.stop()
    # whatever its state: a stopped sandbox is still the key's answer
    replay = await client.run_container(_spec(tag), idempotency_key=key)
    assert replay.id == sb.id and replay.info.state is SandboxState.STOPPED


async def test_concurrent_first_creates_make_one(client: DSecClient) -> None:
    tag, key = secrets.token_hex(4), secrets.token_hex(16)
    made = await asyncio.gather(
        *(client.run_container(_spec(tag), idempotency_key=key) for _ in range(6))
    )
    assert len({m.id for m in made}) == 1
    assert await _live(client, tag) == [made[0].id]


async def test_same_key_other_spec_is_409(plat: PlatformProcess, client: DSecClient) -> None:
    tag, key = secrets.token_hex(4), secrets.token_hex(16)
    sb = await client.run_container(_spec(tag), idempotency_key=key)
    with pytest.raises(IdempotencyKeyReused) as exc:
        await client.run_container(_spec(tag, memory=128), idempotency_key=key)
    assert exc.value.details["key"] == key
    with _http(plat) as h:
        r = _post(h, _spec(tag, memory=128), key)
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "idempotency_key_reused"
    assert await _live(client, tag) == [sb.id]


@pytest.mark.parametrize(
    "bad", ["", "has space", "x" * 256, "semi;colon", "ключ".encode(), "tab\there"]
)
async def test_invalid_key_is_422(plat: PlatformProcess, client: DSecClient, bad: str) -> None:
    tag = secrets.token_hex(4)
    with _http(plat) as h:
        r = _post(h, _spec(tag), bad)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_argument"
    assert HEADER in r.json()["error"]["message"]
    if isinstance(bad, str):
        with pytest.raises(InvalidArgument, match="idempotency_key"):
            await client.run_container(_spec(tag), idempotency_key=bad)
    assert await _live(client, tag) == []


async def test_failed_create_gives_its_key_back(client: DSecClient) -> None:
    tag, key = secrets.token_hex(4), secrets.token_hex(16)
    missing = _spec(tag).model_copy(update={"container_image": "no-such-image:latest"})
    for _ in range(2):  # the same error again, not a replay of a failure nor a 409
        with pytest.raises(ImageNotFound):
            await client.run_container(missing, idempotency_key=key)
    sb = await client.run_container(_spec(tag), idempotency_key=key)  # free: a new spec
    assert sb.info.state is SandboxState.RUNNING


async def test_keys_are_per_principal_and_replays_are_not_charged(
    plat: PlatformProcess, client: DSecClient
) -> None:
    tag, key = secrets.token_hex(4), secrets.token_hex(16)
    project, runner = f"idem-{tag}", f"idem-runner-{tag}"
    await client.create_project(project)
    await client.set_quota(project, max_sandboxes=1, memory_mb=512)
    await client.create_principal(runner, default_project=project)
    await client.grant(runner, "runtime", project=project)
    other = DSecClient(plat.url, (await client.create_key(runner)).key)
    await other.open()
    try:
        mine = await other.run_container(_spec(tag), idempotency_key=key)
        # at its quota of one: a replay is no new sandbox, so no 429
        again = await other.run_container(_spec(tag), idempotency_key=key)
        assert again.id == mine.id
        assert (await client.quota(project)).usage.sandboxes == 1
        # the same key from another principal is another create
        theirs = await client.run_container(_spec(tag), idempotency_key=key)
        assert theirs.id != mine.id
        await mine.stop()
    finally:
        await other.close()


async def test_key_survives_a_crash() -> None:
    with platform_process() as plat:
        tag, key = secrets.token_hex(4), secrets.token_hex(16)
        c = DSecClient(plat.url, plat.api_key)
        await c.open()
        try:
            await c.build_image("busybox")
            sb = await c.run_container(_spec(tag), idempotency_key=key)
        finally:
            await c.close()
        plat.kill()
        plat.start()
        c = DSecClient(plat.url, plat.api_key)
        await c.open()
        try:
            again = await c.run_container(_spec(tag), idempotency_key=key)
            assert again.id == sb.id and again.info.state is SandboxState.RUNNING
            assert (await again.run_shell("echo back")).stdout == "back\n"
            await again.stop()
        finally:
            await c.close()
