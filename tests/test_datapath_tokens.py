"""Data-path tokens: forged, expired, for another sandbox, missing. Real platform."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from dsec import DSecClient, DSecContainerRunArgs, Sandbox
from dsec.edge.tokens import MAX_SIGNED_CACHE, TokenSigner
from dsec.errors import PermissionDenied, Unauthenticated
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root


@pytest.fixture
async def pair(client: DSecClient, busybox_image: str) -> AsyncIterator[tuple[Sandbox, Sandbox]]:
    spec = DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64)
    a = await client.run_container(spec)
    b = await client.run_container(spec)
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def signer(platform: PlatformProcess) -> TokenSigner:
    key_file = platform.data_dir / "edge_token.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    return TokenSigner(key_file.read_bytes())


async def rpc(url: str, sandbox_id: str, token: str | None, op: str = "run") -> dict[str, object]:
    ws_url = url.replace("http://", "ws://") + "/v1/edge/rpc"
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:  # the handshake itself needs a credential carrying our signature
        ws_conn = await connect(ws_url, additional_headers=headers)
    except InvalidStatus as exc:
        refused: dict[str, object] = json.loads(exc.response.body or b"{}")
        return refused
    async with ws_conn as ws:
        msg: dict[str, object] = {"id": 1, "op": op, "sandbox": sandbox_id}
        msg["args"] = {"command": "echo pwned > /tmp/pwned"}
        if token is not None:
            msg["token"] = token
        await ws.send(json.dumps(msg))
        reply: dict[str, object] = json.loads(await ws.recv())
        return reply


def error_code(reply: dict[str, object]) -> str:
    err = reply.get("error")
    assert isinstance(err, dict), reply
    return str(err["code"])


async def test_token_misuse_is_refused(
    platform: PlatformProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, b = pair
    assert a.info.data_path is not None and b.info.data_path is not None
    url, token_a = a.info.data_path.url, a.info.data_path.token
    sig = signer(platform)
    expired = sig.mint(a.id, ttl=-5).value
    forged = TokenSigner(b"k" * 32).mint(a.id).value
    tampered = token_a.replace(a.id, b.id)  # right shape, signature no longer matches
    view = (await platform_token(platform, a.id, "view-token"))["token"]
    assert view.startswith("dsv1.")
    cases = {
        "view only": (a.id, view, "permission_denied", 403),
        "view turned full": (a.id, "dst1" + view[4:], "unauthenticated", 401),
        "other sandbox": (b.id, token_a, "permission_denied", 403),
        "expired": (a.id, expired, "unauthenticated", 401),
        "forged": (a.id, forged, "unauthenticated", 401),
        "tampered": (b.id, tampered, "unauthenticated", 401),
        "garbage": (a.id, "dst1.x.y.z", "unauthenticated", 401),
        "missing": (a.id, None, "unauthenticated", 401),
    }
    async with httpx.AsyncClient(base_url=url) as http:
        for name, (sid, token, code, status) in cases.items():
            assert error_code(await rpc(url, sid, token)) == code, name
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            resp = await http.get(
                f"/v1/edge/sandboxes/{sid}/files", params={"path": "/etc/passwd"}, headers=headers
            )
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), name
            resp = await http.put(
                f"/v1/edge/sandboxes/{sid}/archive", params={"path": "/x"}, headers=headers
            )
            assert resp.status_code == status, name
            async with connect(
                url.replace("http://", "ws://")
                + f"/v1/edge/sandboxes/{sid}/pty"
                + (f"?token={token}" if token else "")
            ) as ws:
                first = json.loads(await ws.recv())
                assert first["type"] == "error" and first["error"]["code"] == code, name
        # A token is no API key: it opens nothing on the control API.
        resp = await http.get("/v1/sandboxes", headers={"Authorization": f"Bearer {token_a}"})
        assert resp.status_code == 401
    for sandbox in (a, b):
        assert not await sandbox.exists("/tmp/pwned")
    # The right token works, on its own sandbox only.
    assert (await rpc(url, a.id, token_a))["result"] is not None


async def test_sdk_renews_and_reports(
    platform: PlatformProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, b = pair
    assert a.info.data_path is not None
    # An expired token held by the SDK is renewed transparently.
    a.info.data_path.token = signer(platform).mint(a.id, ttl=-5).value
    a._data._infos[a.id] = a.info.data_path
    assert (await a.run_shell("echo renewed")).stdout == "renewed\n"
    # A token for the wrong sandbox is a typed PermissionDenied through the SDK too.
    token_b = b.info.data_path.token if b.info.data_path else ""
    with pytest.raises(PermissionDenied):
        await a._data._rpc(a.info.data_path.url).call("ping", a.id, {}, token=token_b)
    with pytest.raises(Unauthenticated):
        await a._data._rpc(a.info.data_path.url).call("ping", a.id, {}, token="dst1.a.1.b")
    fresh = await platform_token(platform, a.id)
    assert fresh["url"] == a.info.data_path.url and fresh["token"].startswith("dst1.")


async def platform_token(
    platform: PlatformProcess, sandbox_id: str, kind: str = "token"
) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=platform.url) as http:
        resp = await http.post(
            f"/v1/sandboxes/{sandbox_id}/{kind}",
            headers={"Authorization": f"Bearer {platform.api_key}"},
        )
        assert resp.status_code == 200
        body: dict[str, str] = resp.json()
        resp = await http.post(f"/v1/sandboxes/{sandbox_id}/{kind}")
        assert resp.status_code == 401
        return body


def test_signer_unit() -> None:
    s = TokenSigner(b"s" * 32, ttl=60)
    tok = s.mint("e0-0123456789abcdef", now=1000)
    s.verify(tok.value, "e0-0123456789abcdef", now=1059)
    with pytest.raises(Unauthenticated, match="expired"):
        s.verify(tok.value, "e0-0123456789abcdef", now=1060)
    with pytest.raises(PermissionDenied):
        s.verify(tok.value, "e0-aaaaaaaaaaaaaaaa", now=1000)
    with pytest.raises(Unauthenticated, match="signature"):
        s.verify(tok.value[:-2] + "AA", "e0-0123456789abcdef", now=1000)
    with pytest.raises(Unauthenticated):
        s.verify("x" * 500, "e0-0123456789abcdef")
    # A view token opens the live view only; its prefix is signed, so it stays one.
    view = s.mint("e0-0123456789abcdef", now=1000, scope="view").value
    assert view.startswith("dsv1.")
    s.verify(view, "e0-0123456789abcdef", now=1000, scope="view")
    s.verify(tok.value, "e0-0123456789abcdef", now=1000, scope="view")  # full covers view
    with pytest.raises(PermissionDenied, match="only opens the live view"):
        s.verify(view, "e0-0123456789abcdef", now=1000)
    with pytest.raises(Unauthenticated, match="signature"):
        s.verify("dst1" + view[4:], "e0-0123456789abcdef", now=1000)


def test_signer_remembers_only_good_signatures() -> None:
    """The verified-signature cache (it saves the HMAC of every data-path frame) changes
    no answer: a forged signature of a remembered body, an expired or a foreign token
    fail as before, and a full cache starts over."""
    s = TokenSigner(b"s" * 32, ttl=60)
    sid = "e0-0123456789abcdef"
    tok = s.mint(sid, now=1000).value
    for _ in range(2):  # the second time from the cache
        s.verify(tok, sid, now=1000)
        with pytest.raises(Unauthenticated, match="signature"):
            s.verify(tok[:-2] + ("AA" if not tok.endswith("AA") else "BB"), sid, now=1000)
        with pytest.raises(Unauthenticated, match="expired"):
            s.verify(tok, sid, now=1060)
        with pytest.raises(PermissionDenied):
            s.verify(tok, "e0-aaaaaaaaaaaaaaaa", now=1000)
    for i in range(MAX_SIGNED_CACHE + 10):
        s.verify(s.mint(sid, now=1000 + i).value, sid, now=1000)
    s.verify(tok, sid, now=1000)
