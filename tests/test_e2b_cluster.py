"""The unmodified `e2b` SDK against a cluster apiserver (dsec.compat.e2b.forward).

One cluster for the module (tests/cluster_env.py: PostgreSQL, an apiserver, a watcher
and two edges in their own network namespaces), E2B_API_URL = E2B_SANDBOX_URL = the
apiserver: control calls go through its router, envd is relayed to the sandbox's edge.
Sync and async SDK, multi-MiB bodies both ways, and what a hostile caller tries. The
last test stops an edge: its sandboxes' envd answers ``unavailable``, never a 500.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxQuery,
)

from dsec import DSecSyncClient  # noqa: E402
from tests.cluster_env import Cluster, cluster  # noqa: E402
from tests.pg import PostgresServer  # noqa: E402

pytestmark = pytest.mark.timeout(600)
IMAGE = "busybox:latest"
MiB = 1 << 20


@pytest.fixture(scope="module")
def e2b_cluster(postgres: PostgresServer) -> Iterator[Cluster]:
    with cluster(postgres, apiservers=1) as c:
        for i in range(2):
            c.add_edge(i, capacity=20)
        for edge in c.edges.values():
            with DSecSyncClient(edge.url, c.token) as client:
                client.build_image("busybox")
        c.wait_edges_up(2)
        c.wait_edges_have(IMAGE)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("E2B_API_URL", c.api_urls[0])
            mp.setenv("E2B_SANDBOX_URL", c.api_urls[0])
            mp.setenv("E2B_API_KEY", c.admin_key)
            yield c


@pytest.fixture(scope="module")
def boxes(e2b_cluster: Cluster) -> Iterator[list[Sandbox]]:
    """Sandboxes until both edges hold one (placement spreads; a few creates at most)."""
    made: list[Sandbox] = []
    try:
        while len({b.sandbox_id.split("-")[0] for b in made}) < 2 and len(made) < 6:
            made.append(Sandbox.create(IMAGE, metadata={"suite": "e2bc"}, envs={"G": "hi"}))
        yield made
    finally:
        for box in made:
            box.kill()


def test_sandboxes_live_on_both_edges(e2b_cluster: Cluster, boxes: list[Sandbox]) -> None:
    edges = {b.sandbox_id.split("-")[0] for b in boxes}
    assert edges <= set(e2b_cluster.edges) and len(edges) == 2


def test_commands_stream_through_the_apiserver(boxes: list[Sandbox]) -> None:
    for sbx in boxes:
        out: list[str] = []
        result = sbx.commands.run("echo $G; whoami; pwd", on_stdout=out.append)
        assert result.stdout.split() == ["hi", "user", "/home/user"]
        assert "".join(out).split() == ["hi", "user", "/home/user"]
        with pytest.raises(CommandExitException) as info:
            sbx.commands.run("echo bad; exit 3")
        assert info.value.exit_code == 3 and "bad" in info.value.stdout
    # the user travels in envd's own Authorization (Basic), passed up to the edge
    assert boxes[0].commands.run("whoami", user="root").stdout.strip() == "root"
    big = boxes[0].commands.run("seq 1 200000")  # ~1.3 MB in many envelopes, none lost
    lines = big.stdout.split()
    assert len(lines) == 200000 and lines[-1] == "200000"


def test_background_connect_stdin_kill(boxes: list[Sandbox]) -> None:
    sbx = boxes[-1]
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "ping\n")
    again = sbx.commands.connect(handle.pid)
    sbx.commands.close_stdin(handle.pid)
    result = again.wait()
    assert result.exit_code == 0 and "ping" in result.stdout
    sleeper = sbx.commands.run("sleep 300", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as info:
        sleeper.wait()
    assert info.value.exit_code == 137


def test_files_multi_mib_both_ways(boxes: list[Sandbox]) -> None:
    body = os.urandom(6 * MiB + 123)
    digest = hashlib.sha256(body).hexdigest()
    for sbx in boxes:
        sbx.files.write("/tmp/big.bin", body, use_octet_stream=True)  # raw body
        sbx.files.write("up/multi.bin", body)  # multipart
        assert sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest
        assert bytes(sbx.files.read("/tmp/big.bin", format="bytes")) == body
        assert bytes(sbx.files.read("up/multi.bin", format="bytes")) == body
        assert sbx.files.get_info("/tmp/big.bin").size == len(body)
        assert sbx.files.get_info("/home/user/up").type == FileType.DIR
        assert [e.name for e in sbx.files.list("up")] == ["multi.bin"]
        with pytest.raises(NotFoundException):
            sbx.files.read("/tmp/nope")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_the_relay_does_not_buffer_bodies(e2b_cluster: Cluster, boxes: list[Sandbox]) -> None:
    """48 MiB up and down through the apiserver: its peak RSS grows by far less (the
    relay holds a chunk at a time, not the body)."""
    proc = e2b_cluster.apiservers[0].proc
    assert proc is not None
    sbx, size = boxes[0], 48 * MiB
    body = os.urandom(size)
    before = _peak_rss(proc.pid)
    sbx.files.write("/tmp/huge.bin", body, use_octet_stream=True)
    assert sbx.commands.run("wc -c < /tmp/huge.bin").stdout.strip() == str(size)
    assert bytes(sbx.files.read("/tmp/huge.bin", format="bytes")) == body
    grown = _peak_rss(proc.pid) - before
    assert grown < size // 3, f"the apiserver's peak RSS grew by {grown} bytes"
    sbx.commands.run("rm /tmp/huge.bin")


def test_list_info_timeout_pause_resume(e2b_cluster: Cluster, boxes: list[Sandbox]) -> None:
    tag = secrets.token_hex(4)
    a = Sandbox.create(IMAGE, metadata={"t": tag}, timeout=120)
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2bc"}))
        assert sorted(s.sandbox_id for s in pager.next_items()) == sorted(
            b.sandbox_id for b in boxes
        )
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id and info.metadata == {"t": tag}
        a.set_timeout(60)
        a.pause()
        assert Sandbox.get_info(a.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(a.sandbox_id)
        assert resumed.commands.run("echo back").stdout == "back\n"
    finally:
        assert a.kill() is True
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.sandbox_id)
    assert Sandbox.kill(a.sandbox_id) is False


def test_idempotency_key_through_the_cluster(e2b_cluster: Cluster) -> None:
    key = "e2bc-" + secrets.token_hex(6)
    first = Sandbox.create(IMAGE, idempotency_key=key)
    try:
        assert Sandbox.create(IMAGE, idempotency_key=key).sandbox_id == first.sandbox_id
    finally:
        first.kill()


def test_quota_and_roles_hold_as_for_our_sdk(e2b_cluster: Cluster) -> None:
    """The cluster's IAM charges E2B creates as ours: over the quota is the SDK's
    RateLimitException (429), and a sandbox ended by E2B gives its charge back."""
    c, suffix = e2b_cluster, secrets.token_hex(3)
    project = f"e2bq{suffix}"
    with DSecSyncClient(c.api_urls[0], c.admin_key) as admin:
        admin.create_project(project)
        admin.set_quota(project, max_sandboxes=1)
        admin.create_principal(f"runner{suffix}", default_project=project)
        admin.grant(f"runner{suffix}", "runtime", project=project)
        key = admin.create_key(f"runner{suffix}").key
        first = Sandbox.create(IMAGE, api_key=key)
        try:
            assert first.sandbox_id.split("-")[0] in c.edges
            with pytest.raises(RateLimitException, match="quota"):
                Sandbox.create(IMAGE, api_key=key)
        finally:
            assert first.kill() is True
        assert admin.quota(project).usage.sandboxes == 0
        again = Sandbox.create(IMAGE, api_key=key)  # the slot is free again
        again.kill()


async def test_async_sdk_through_the_cluster(e2b_cluster: Cluster) -> None:
    box = await AsyncSandbox.create(IMAGE)
    try:
        out: list[str] = []
        result = await box.commands.run("echo one; echo two", on_stdout=out.append)
        assert result.stdout == "one\ntwo\n" and "".join(out) == "one\ntwo\n"
        handle = await box.commands.run("read x; echo got $x", background=True, stdin=True)
        await box.commands.send_stdin(handle.pid, "it\n")
        assert (await handle.wait()).stdout == "got it\n"
        body = os.urandom(3 * MiB)
        await box.files.write("a/b.bin", body)
        assert bytes(await box.files.read("/home/user/a/b.bin", format="bytes")) == body
        assert [e.name for e in await box.files.list("a")] == ["b.bin"]
        assert await box.is_running()
    finally:
        await box.kill()


def _stream_request(message: dict[str, object]) -> bytes:
    import json

    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def test_hostile_callers(e2b_cluster: Cluster, boxes: list[Sandbox]) -> None:
    c, sbx, other = e2b_cluster, boxes[0], boxes[1]
    url = c.api_urls[0]
    with pytest.raises(AuthenticationException):
        Sandbox.create(IMAGE, api_key="dsk_not_a_key")
    with pytest.raises(NotFoundException):
        Sandbox.connect("zz9-" + sbx.sandbox_id.split("-", 1)[1])  # no such edge
    # Another project's key sees neither our sandbox nor its envd.
    suffix = secrets.token_hex(3)
    with DSecSyncClient(url, c.admin_key) as admin:
        admin.create_project(f"other{suffix}")
        admin.create_principal(f"stranger{suffix}", default_project=f"other{suffix}")
        admin.grant(f"stranger{suffix}", "runtime", project=f"other{suffix}")
        key = admin.create_key(f"stranger{suffix}").key
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=key)
    assert Sandbox.kill(sbx.sandbox_id, api_key=key) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=key).next_items()]
    unary = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"}
    stranger = httpx.post(
        f"{url}/filesystem.Filesystem/Stat", json={"path": "/"}, headers={**unary, "X-API-KEY": key}
    )
    assert stranger.status_code == 404 and stranger.json()["code"] == "not_found", stranger.text
    # The API key alone works for its owner (the apiserver gets a token from the edge).
    mine = httpx.post(
        f"{url}/filesystem.Filesystem/Stat",
        json={"path": "/tmp"},
        headers={**unary, "X-API-KEY": c.admin_key},
    )
    assert mine.status_code == 200 and mine.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    # A forged token: refused by the edge, as envd's typed error (unary and stream).
    forged = httpx.post(
        f"{url}/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={**unary, "X-Access-Token": "dst1.x.y.z"},
    )
    assert forged.status_code == 401 and forged.json()["code"] == "unauthenticated"
    stream = httpx.post(
        f"{url}/process.Process/Start",
        content=_stream_request({"process": {"cmd": "/bin/sh", "args": ["-c", "id"]}}),
        headers={
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "Content-Type": "application/connect+json",
            "X-Access-Token": "dst1.x.y.z",
        },
    )
    assert stream.status_code == 200
    flags, length = struct.unpack(">BI", stream.content[:5])
    assert flags == 2 and b"unauthenticated" in stream.content[5 : 5 + length]
    # A real token opens its own sandbox only, on whichever edge.
    api = {"X-API-KEY": c.admin_key}
    token = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers=api).json()["envdAccessToken"]
    crossed = httpx.get(
        f"{url}/files",
        params={"path": "/etc/hostname"},
        headers={"E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": token},
    )
    assert crossed.status_code in (401, 403) and "message" in crossed.json()
    anon = httpx.get(
        f"{url}/files", params={"path": "/etc/passwd"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id}
    )
    assert anon.status_code == 401 and "message" in anon.json()
    nobody = httpx.post(f"{url}/filesystem.Filesystem/Stat", json={"path": "/"})
    assert nobody.status_code == 404 and nobody.json()["code"] == "not_found"
    bad_id = httpx.post(
        f"{url}/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={"E2b-Sandbox-Id": "../../v1/health", "X-Access-Token": token},
    )
    assert 400 <= bad_id.status_code < 500
    climb = httpx.post(
        f"{url}/process.Process/Start.json",
        json={},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token},
    )
    assert climb.status_code == 404 and climb.json()["code"] == "not_found"


def _links_to(edge_url: str) -> int:
    """Established TCP connections from this host's netns (the apiserver's) to an edge."""
    addr = urlsplit(edge_url)
    argv = ["ss", "-Htn", "state", "established", "dst", f"{addr.hostname}:{addr.port}"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10)
    return len(out.stdout.splitlines())


def test_a_client_that_goes_closes_the_relayed_stream(
    e2b_cluster: Cluster, boxes: list[Sandbox]
) -> None:
    """Streams that send nothing for a while (no keepalive due for 30 s) are relayed
    live, and a caller that hangs up ends the apiserver's request to the edge at once:
    its connection there closes (a half-read answer is not pooled)."""
    c, sbx = e2b_cluster, boxes[0]
    edge = c.edges[sbx.sandbox_id.split("-")[0]]
    api = {"X-API-KEY": c.admin_key}
    token = httpx.get(f"{c.api_urls[0]}/sandboxes/{sbx.sandbox_id}", headers=api).json()
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "Content-Type": "application/connect+json",
        "X-Access-Token": token["envdAccessToken"],
    }
    body = _stream_request({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 600"]}})
    n, pids, held = 4, [], []
    clients = [httpx.Client(timeout=30) for _ in range(n)]
    try:
        for client in clients:
            req = client.build_request(
                "POST", f"{c.api_urls[0]}/process.Process/Start", content=body, headers=headers
            )
            resp = client.send(req, stream=True)
            held.append(resp.iter_raw())  # held: a dropped iterator closes its answer
            first = next(held[-1])  # the start event, relayed before any end
            assert first[0] == 0 and b'"start"' in first
            pids.append(int(first.split(b'"pid":')[1].split(b"}")[0]))
        during = _links_to(edge.url)
        assert during >= n
        for client in clients:
            client.close()  # hang up mid-stream
        deadline = time.monotonic() + 10
        while _links_to(edge.url) > during - n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _links_to(edge.url) <= during - n
        # as in envd, the commands outlive the streams that started them
        running = {p.pid for p in sbx.commands.list()}
        assert set(pids) <= running
    finally:
        for client in clients:
            client.close()
        for pid in pids:
            sbx.commands.kill(pid)


def test_an_edge_that_is_gone_is_unavailable(e2b_cluster: Cluster) -> None:
    """Last: kills an edge (SIGKILL, as a crash). A stream relayed from it ends with
    Connect ``unavailable``; a new call answers ``unavailable`` (503); never a 500.
    The edge then comes back and re-adopts its sandbox, which is killed."""
    c = e2b_cluster
    box = Sandbox.create(IMAGE)
    victim = c.edges[box.sandbox_id.split("-")[0]]
    api = {"X-API-KEY": c.admin_key}
    token = httpx.get(f"{c.api_urls[0]}/sandboxes/{box.sandbox_id}", headers=api).json()
    headers = {
        "E2b-Sandbox-Id": box.sandbox_id,
        "Content-Type": "application/connect+json",
        "X-Access-Token": token["envdAccessToken"],
    }
    body = _stream_request({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 600"]}})
    try:
        with httpx.Client(timeout=60) as client:
            req = client.build_request(
                "POST", f"{c.api_urls[0]}/process.Process/Start", content=body, headers=headers
            )
            resp = client.send(req, stream=True)
            chunks = resp.iter_raw()
            assert b'"start"' in next(chunks)
            victim.proc.kill()
            rest = b"".join(chunks)
        flags, length = struct.unpack(">BI", rest[:5])
        assert flags == 2 and b'"unavailable"' in rest[5 : 5 + length], rest
        unary = {**headers, "Content-Type": "application/json"}
        again = httpx.post(
            f"{c.api_urls[0]}/filesystem.Filesystem/Stat",
            json={"path": "/"},
            headers=unary,
            timeout=30,
        )
        assert again.status_code == 503 and again.json()["code"] == "unavailable", again.text
    finally:
        if not victim.proc.alive():
            c.start_edge(victim)  # same data dir: it re-adopts the sandbox
            c.wait_edges_up(2)
    box.kill()


def test_framing_knows_envelope_boundaries_across_chunks() -> None:
    from dsec.compat.e2b import connect as conn
    from dsec.compat.e2b.forward import Framing

    data = conn.message_envelope({"event": {"start": {"pid": 7}}}) + conn.end_stream()
    cut = Framing()
    for i in range(len(data)):  # one byte at a time: never a boundary mid-envelope
        cut.feed(data[i : i + 1])
        first_len = len(conn.message_envelope({"event": {"start": {"pid": 7}}}))
        assert cut.at_boundary == (i + 1 in (first_len, len(data)))
    assert cut.ended
    half = Framing()
    half.feed(data[:3])
    assert not half.at_boundary and not half.ended
