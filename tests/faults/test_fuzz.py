"""Fuzz-clean: schemathesis against our own OpenAPI spec, hostile WebSocket frames,
slowloris and idle connections, and a bounded SIGTERM, all on a real `dsec up`.

Every 5xx the fuzzer provokes must be a documented typed one (501 ``unsupported``,
503/504/507 with their codes), never a 500 or 502, and the platform's log must hold no
traceback. The bounds asserted are the issue's own (10 s to stop after SIGTERM) and the
lowered header timeout of the test platform, each with a wide margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from dsec.api.datapath import EDGE_PREFIX, RPC_PATH
from dsec.api.fncall import FNCALL_RPC_PATH
from dsec.errors import error_class_for
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

FUZZ_SECONDS = 90  # schemathesis' own time budget (--max-time)
# How long one request to the live audit stream is read. It never ends by design, and
# schemathesis reads an event stream until the request timeout (60 s) has passed: three
# such requests were 2 of the 3 minutes this test took, with the fuzzer idle. Cut at
# STREAM_SECONDS it is still fuzzed and answered 200 (cut short), and FUZZ_SECONDS went
# from 150 to 90 with every operation still reached in both phases, the same status
# classes seen and more fuzzing-phase requests than before (measured: 4,657 requests in
# 195 s before, 4,354 in 102 s after).
STREAM_SECONDS = 5
TYPED_5XX = {501, 503, 504, 507}  # a typed envelope whose code has this status is fine
SHUTDOWN_BOUND_S = 10.0  # the bound for SIGTERM, whatever is in flight


def ws(url: str, path: str) -> str:
    return url.replace("http://", "ws://") + path


def tracebacks(plat: PlatformProcess) -> list[str]:
    text = plat.log_path.read_text(errors="replace") if plat.log_path.exists() else ""
    return [chunk[:1500] for chunk in text.split("Traceback (most recent call last)")[1:]]


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        yield p
        assert not tracebacks(p), tracebacks(p)[:3]


# ---- the OpenAPI fuzzer --------------------------------------------------------------


def untyped_5xx(entry: dict[str, Any]) -> str | None:
    """Why a HAR entry's response is not an acceptable 5xx (None: it is fine)."""
    status = int(entry["response"]["status"])
    if status < 500:
        return None
    text = entry["response"].get("content", {}).get("text") or ""
    try:
        code = json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without the error envelope: {text[:200]!r}"
    if status not in TYPED_5XX or error_class_for(code).status != status:
        return f"{status} {code}: {text[:300]}"
    return None


@pytest.mark.timeout(FUZZ_SECONDS + 300)
def test_schemathesis_finds_no_untyped_5xx(tmp_path: Path) -> None:
    # A platform of its own: the fuzzer changes state (quotas, roles, keys) for real.
    with platform_process() as plat:
        fuzz(plat, tmp_path)
        assert not tracebacks(plat), tracebacks(plat)[:3]


def fuzz(plat: PlatformProcess, tmp_path: Path) -> None:
    har = tmp_path / "fuzz.har"
    st = Path(sys.executable).with_name("st")
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f'[[operations]]\ninclude-path = "/v1/events/stream"\nrequest-timeout = {STREAM_SECONDS}\n'
    )
    argv = [
        str(st),
        "--config-file",
        str(config),
        "run",
        f"{plat.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {plat.api_key}",
        "--checks",
        "not_a_server_error",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "5",
        "--seed",
        "20261201",
        "--workers",
        "2",
        "--max-time",
        str(FUZZ_SECONDS),
        "--request-timeout",
        "60",
        "--no-color",
        # Builds fetch and unpack real images (minutes each, not what is fuzzed here);
        # the live audit stream never ends by design (its filters are /v1/audit's,
        # fuzzed there); revoking keys could revoke this run's own key.
        # NB: schemathesis 4 joins these two options into ONE filter (path AND operation
        # id), which matches no operation ("Unmatched filters" in its output): builds, the
        # stream and the revokes are fuzzed too (hence STREAM_SECONDS; the session's build
        # cache makes a debian-python build a mkfs.erofs). Left as it was: fixing it
        # would drop three kinds of operations from what this test covers today.
        "--exclude-path-regex",
        "/v1/(images|layers)/build|/v1/events/stream",
        "--exclude-operation-id-regex",
        "^revoke",
        "--report",
        "har",
        "--report-har-path",
        str(har),
    ]
    t0 = time.monotonic()
    out = subprocess.run(  # in tmp_path: schemathesis keeps a .schemathesis/ cache in cwd
        argv, capture_output=True, text=True, timeout=FUZZ_SECONDS + 180, cwd=tmp_path
    )
    elapsed = time.monotonic() - t0
    assert har.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(int(e["response"]["status"]) for e in entries)
    bad = [(e["request"]["method"], e["request"]["url"][:200], why) for e in entries
           if (why := untyped_5xx(e)) is not None]  # fmt: skip
    print(
        f"\nschemathesis: {len(entries)} requests in {elapsed:.0f} s; statuses "
        f"{dict(sorted(statuses.items()))}; untyped 5xx {len(bad)}; "
        f"tracebacks {len(tracebacks(plat))}"
    )
    for e in entries:  # no answer at all (a timeout, a dropped connection): say which
        if int(e["response"]["status"]) == 0:
            print("  no response:", e["request"]["method"], e["request"]["url"][:300])
    assert len(entries) >= 1000, out.stdout[-3000:]
    assert not bad, bad[:10]
    assert not tracebacks(plat), tracebacks(plat)[:3]
    assert httpx.get(f"{plat.url}/v1/health", timeout=10).status_code == 200


# ---- WebSocket frames ------------------------------------------------------------------


async def refused(url: str, headers: dict[str, str]) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, additional_headers=headers):
            pass
    resp = info.value.response
    return resp.status_code, json.loads(resp.body or b"{}")["error"]["code"]


@pytest.mark.parametrize("path", [RPC_PATH, FNCALL_RPC_PATH])
async def test_sockets_need_a_credential_at_the_handshake(plat: PlatformProcess, path: str) -> None:
    """Both WebSocket protocols refuse the upgrade itself without a valid credential:
    no socket, so no frame parser, is ever reachable unauthenticated."""
    url = ws(plat.url, path)
    for bad in (
        {},
        {"Authorization": "Bearer dsk_wrong"},
        {"Authorization": "Bearer dst1.x.1.y"},
        {"Authorization": "Basic Zm9vOmJhcg=="},
        {"Authorization": "Bearer "},
    ):
        assert await refused(url, bad) == (401, "unauthenticated"), bad
    async with connect(url, additional_headers={"Authorization": f"Bearer {plat.api_key}"}) as c:
        if path == RPC_PATH:
            await c.send(json.dumps({"id": 1, "op": "ping", "sandbox": "e0-0000000000000000"}))
            assert json.loads(await c.recv())["error"]["code"] == "sandbox_not_found"
        else:
            await c.send(json.dumps({"id": 1, "op": "fncall.nope", "args": {}}))
            assert json.loads(await c.recv())["error"]["code"] == "invalid_argument"


async def closed_with(conn: ClientConnection) -> tuple[str, int]:
    """The typed error frame the server sent, and the close code that followed."""
    frame = json.loads(await asyncio.wait_for(conn.recv(), 30))
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(conn.recv(), 30)
    assert conn.close_code is not None
    return frame["error"]["code"], conn.close_code


@pytest.mark.parametrize("path", [RPC_PATH, FNCALL_RPC_PATH])
async def test_hostile_frames_are_typed_and_close(plat: PlatformProcess, path: str) -> None:
    url = ws(plat.url, path)
    auth = {"Authorization": f"Bearer {plat.api_key}"}
    # Malformed but harmless: a typed answer on id 0, and the connection goes on.
    async with connect(url, additional_headers=auth, max_size=None) as c:
        for text in ("not json", "[1]", '{"id": Infinity, "op": "x"}', '{"id": -1, "op": "x"}'):
            await c.send(text)
            reply = json.loads(await c.recv())
            assert (reply["id"], reply["error"]["code"]) == (0, "invalid_argument"), text
    # Deeply nested: a typed error, then the server closes (4000 + status).
    async with connect(url, additional_headers=auth, max_size=None) as c:
        await c.send("[" * 200_000 + "]" * 200_000)
        assert await closed_with(c) == ("invalid_argument", 4422)
    async with connect(url, additional_headers=auth, max_size=None) as c:
        await c.send('{"id": 1, "op": "run", "args": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001)
        assert await closed_with(c) == ("invalid_argument", 4422)
    # Over the frame cap: typed 413 and closed; far over it: closed by the protocol.
    async with connect(url, additional_headers=auth, max_size=None) as c:
        await c.send('{"id": 1, "op": "x", "pad": "' + "a" * (16 << 20) + '"}')
        assert await closed_with(c) == ("payload_too_large", 4413)
    async with connect(url, additional_headers=auth, max_size=None) as c:
        await c.send(b"x" * (32 << 20))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(c.recv(), 30)
        assert c.close_code == 1009
    assert not tracebacks(plat), tracebacks(plat)[:3]


async def test_terminal_refuses_garbage_control_frames(plat: PlatformProcess) -> None:
    async with httpx.AsyncClient(
        base_url=plat.url, headers={"Authorization": f"Bearer {plat.api_key}"}, timeout=120
    ) as http:
        r = await http.post("/v1/images/build", json={"recipe": "busybox"})
        assert r.status_code == 200, r.text
        spec = {"spec": {"container_image": "busybox:latest", "memory_limit_mb": 64}}
        r = await http.post("/v1/sandboxes", json=spec)
        assert r.status_code == 201, r.text
        sid, token = r.json()["id"], r.json()["data_path"]["token"]
        try:
            url = ws(plat.url, f"{EDGE_PREFIX}/{sid}/pty?token={token}")
            for frame, code in (
                ("[" * 4000, "invalid_argument"),  # deeper than the parser follows
                ("not json", "invalid_argument"),
                ('{"type": "resize", "rows": 0, "cols": 80}', "invalid_argument"),
                ('{"type": "resize", "pad": "' + "a" * 10_000 + '"}', "payload_too_large"),
            ):
                async with connect(url) as c:
                    await c.send(json.dumps({"type": "future-message"}))  # ignored
                    await c.send(frame)
                    error = None
                    with contextlib.suppress(ConnectionClosed):
                        while error is None:
                            msg = await asyncio.wait_for(c.recv(), 30)
                            if isinstance(msg, str) and json.loads(msg).get("type") == "error":
                                error = json.loads(msg)["error"]["code"]
                    assert error == code, frame[:40]
        finally:
            await http.delete(f"/v1/sandboxes/{sid}")
    assert not tracebacks(plat), tracebacks(plat)[:3]


# ---- slowloris, idle connections -------------------------------------------------------

HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 40


@pytest.fixture(scope="module")
def guarded() -> Iterator[PlatformProcess]:
    env = {"DSEC_HEADER_TIMEOUT": str(HEADER_TIMEOUT), "DSEC_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with platform_process(**env) as p:
        yield p
        assert not tracebacks(p), tracebacks(p)[:3]


def open_socket(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    return s


def test_slowloris_is_dropped_within_the_header_timeout(guarded: PlatformProcess) -> None:
    request = b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60
    with open_socket(guarded.port) as s:
        t0 = time.monotonic()
        dropped = None
        for byte in request:  # one header byte a second, never the end of the headers
            try:
                s.sendall(bytes([byte]))
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    dropped = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:
                dropped = time.monotonic() - t0
                break
        assert dropped is not None, "the slow client was never dropped"
    print(f"\nslowloris dropped after {dropped:.1f} s (header timeout {HEADER_TIMEOUT} s)")
    assert dropped < HEADER_TIMEOUT + 8  # wide margin on a shared machine
    # Huge headers: 431, typed, at once.
    with open_socket(guarded.port) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"b" * 100_000)
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 431") and b"payload_too_large" in head, head[:300]


def test_idle_connections_do_not_pin_the_server(guarded: PlatformProcess) -> None:
    health = f"{guarded.url}/v1/health"
    # Connections that never send a request: the limit answers the rest with a typed
    # 503 while they are held, and the header timeout frees them all.
    idle = [open_socket(guarded.port) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        time.sleep(0.5)
        r = httpx.get(health, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "unavailable"), r.text
        deadline = time.monotonic() + HEADER_TIMEOUT + 10
        while httpx.get(health, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "idle connections still pin the server"
            time.sleep(0.2)
    finally:
        for s in idle:
            s.close()
    # Keep-alive connections idle between requests are closed to make room at once.
    clients = [httpx.Client(timeout=30) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        for c in clients:
            c.get(health)  # each keeps its connection open afterwards
        for _ in range(5):
            assert httpx.get(health, timeout=30).status_code == 200
    finally:
        for c in clients:
            c.close()


# ---- SIGTERM ---------------------------------------------------------------------------


def test_sigterm_is_bounded_whatever_is_in_flight() -> None:
    with platform_process() as plat:
        assert plat.proc is not None
        auth = {"Authorization": f"Bearer {plat.api_key}"}
        http = httpx.Client(base_url=plat.url, headers=auth, timeout=120)
        assert http.post("/v1/images/build", json={"recipe": "busybox"}).status_code == 200
        spec = {"spec": {"container_image": "busybox:latest", "memory_limit_mb": 64}}
        sids = []
        for _ in range(2):
            r = http.post("/v1/sandboxes", json=spec)
            assert r.status_code == 201, r.text
            sids.append(r.json()["id"])
        # In flight: a long exec, an open data-path socket running a long command, a
        # half-sent upload, an idle keep-alive connection.
        long_exec = httpx.Client(base_url=plat.url, headers=auth, timeout=120)
        execs = threading.Thread(
            target=_quiet,
            args=(
                lambda: long_exec.post(
                    f"/v1/sandboxes/{sids[0]}/exec", json={"command": "sleep 600"}
                ),
            ),
            daemon=True,
        )
        execs.start()
        loop = asyncio.new_event_loop()
        sock_ready = threading.Event()

        async def hold_socket() -> None:
            async with connect(ws(plat.url, RPC_PATH), additional_headers=auth) as c:
                await c.send(
                    json.dumps(
                        {"id": 1, "op": "run", "sandbox": sids[1], "args": {"command": "sleep 600"}}
                    )
                )
                sock_ready.set()
                with contextlib.suppress(ConnectionClosed):
                    async for _ in c:
                        pass

        holder = threading.Thread(
            target=_quiet, args=(lambda: loop.run_until_complete(hold_socket()),), daemon=True
        )
        holder.start()
        upload = open_socket(plat.port)
        upload.sendall(
            f"PUT /v1/sandboxes/{sids[0]}/files?path=/root/half HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {plat.api_key}\r\nContent-Length: {1 << 30}\r\n\r\n".encode()
            + os.urandom(1 << 20)
        )
        assert http.get("/v1/health").status_code == 200  # the keep-alive one
        assert sock_ready.wait(30)
        time.sleep(1.0)  # the exec and the socket's command are running
        t0 = time.monotonic()
        plat.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            plat.proc.wait(60)
        took = time.monotonic() - t0
        upload.close()
        http.close()
        execs.join(10)
        long_exec.close()
        print(f"\nSIGTERM with a long exec, a socket, a half upload in flight: {took:.1f} s")
        assert plat.proc.poll() is not None, "still running 60 s after SIGTERM"
        assert took < SHUTDOWN_BOUND_S
        assert not tracebacks(plat), tracebacks(plat)[:3]
        holder.join(10)
        loop.close()


def _quiet(fn: Any) -> None:
    with contextlib.suppress(Exception):
        fn()
