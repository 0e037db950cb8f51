"""A cluster's apiserver serves the live audit stream: a real PostgreSQL, an apiserver,
a watcher and two edges in their own network namespaces (tests/cluster_env.py). Every
edge's records are fanned in as one stream whose event ids are cursors over the edges.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from dsec import DSecSyncClient
from dsec.cluster.fanout import parse_cursor
from dsec.errors import InvalidArgument
from dsec.sdk.sync import SyncSandbox
from tests.browser import busybox_sandboxes
from tests.cluster_env import Cluster, busybox_cluster
from tests.pg import PostgresServer

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

Frame = tuple[str, dict[str, object]]  # (the SSE id, the record)


@pytest.fixture(scope="module")
def two_edges(postgres: PostgresServer) -> Iterator[Cluster]:
    with busybox_cluster(postgres, edges=2, apiservers=1, capacity=10) as c:
        yield c


@pytest.fixture(scope="module")
def url(two_edges: Cluster) -> str:
    return two_edges.api_urls[0]


@pytest.fixture
def spread(two_edges: Cluster) -> Iterator[list[SyncSandbox]]:
    """One sandbox of a fresh job on each edge, created through the apiserver."""
    job = "uic-" + secrets.token_hex(3)
    with (
        DSecSyncClient(two_edges.api_urls[0], two_edges.admin_key, timeout=120) as api,
        busybox_sandboxes(api) as make,
    ):
        by_edge: dict[str, SyncSandbox] = {}
        for _ in range(12):
            sb = make(job_id=job)
            by_edge.setdefault(sb.id.split("-")[0], sb)
            if len(by_edge) == 2:
                break
        assert len(by_edge) == 2, "placement used one edge only"
        yield [by_edge[e] for e in sorted(by_edge)]


def follow(
    url: str, key: str, done: Callable[[list[Frame]], bool], headers: dict[str, str] | None = None
) -> list[Frame]:
    """``/v1/events/stream?kind=event`` frames until ``done`` holds (within 20 s)."""
    frames: list[Frame] = []
    deadline = time.monotonic() + 20
    auth = {"Authorization": f"Bearer {key}", **(headers or {})}
    timeout = httpx.Timeout(5.0, read=3.0)
    with httpx.stream(
        "GET", url + "/v1/events/stream", params={"kind": "event"}, headers=auth, timeout=timeout
    ) as resp:
        assert resp.status_code == 200, resp.read()
        current: dict[str, str] = {}
        for line in resp.iter_lines():
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                current[name] = value
            elif not line and "data" in current:
                frames.append((current["id"], json.loads(current["data"])))
                current = {}
                if done(frames):
                    return frames
            assert time.monotonic() < deadline, f"stream ended early: {frames}"
    raise AssertionError(f"stream closed: {frames}")


def test_the_stream_resumes_from_its_cursor(
    two_edges: Cluster, url: str, spread: list[SyncSandbox]
) -> None:
    """Every frame's id is a cursor over the edges; Last-Event-ID resumes after it
    (what EventSource sends), and a cursor is checked client input."""
    key = two_edges.admin_key
    for sb in spread:
        sb.run_shell("reboot -f; true")
    ids = {sb.id for sb in spread}

    def both(frames: list[Frame]) -> bool:
        return ids <= {str(r["sandbox_id"]) for _, r in frames}

    frames = follow(url, key, both)
    seen = {(r["sandbox_id"], r["seq"]) for _, r in frames}
    # ids name edges of this cluster only, each at the seq of its last record sent
    last_id, last = frames[-1]
    assert set(parse_cursor(last_id)) <= set(two_edges.edges)
    assert parse_cursor(last_id)[str(last["sandbox_id"]).split("-")[0]] == last["seq"]
    # resumed after the first frame: exactly the rest, nothing repeated
    rest = follow(url, key, lambda f: len(f) >= len(frames) - 1, {"Last-Event-ID": frames[0][0]})
    assert [(r["sandbox_id"], r["seq"]) for _, r in rest] == [
        (r["sandbox_id"], r["seq"]) for _, r in frames[1:]
    ] or {(r["sandbox_id"], r["seq"]) for _, r in rest} == seen - {
        (frames[0][1]["sandbox_id"], frames[0][1]["seq"])
    }
    # resumed after the last one: only what is new (a fresh event on one edge)
    edge = spread[0].id.split("-")[0]
    before = parse_cursor(last_id).get(edge, 0)
    spread[0].run_shell("reboot -f; true")

    def new_one(f: list[Frame]) -> bool:
        return any(r["sandbox_id"] == spread[0].id and int(str(r["seq"])) > before for _, r in f)

    fresh = follow(url, key, new_one, {"Last-Event-ID": last_id})
    assert not {(r["sandbox_id"], r["seq"]) for _, r in fresh} & seen

    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as h:
        # a digit str.isdigit() takes and int() does not; not an edge id; a bad part
        for text in (f"{edge}:\u00b2", "NOT AN EDGE:1", f"{edge}:1,", f"{edge}:" + "9" * 19):
            bad = text.encode("latin-1")  # as a header carries it
            r = h.get("/v1/events/stream", headers={b"Last-Event-ID": bad})
            assert r.status_code == 422, (bad, r.text[:200])
            assert r.json()["error"]["code"] == "invalid_argument"
        r = h.get("/v1/events/stream", params={"cursor": "x" * 10})
        assert r.status_code == 422
        r = h.get("/v1/events/stream", params={"since_seq": 5})  # per edge: a cursor only
        assert r.status_code == 422 and "cursor" in r.json()["error"]["message"]
    with pytest.raises(InvalidArgument):  # bounded: more edges than any cluster has
        parse_cursor(",".join(f"e{i}:1" for i in range(10_001)))
    # an edge this cluster does not know is dropped from the cursor, not echoed
    unknown = follow(url, key, lambda f: len(f) >= 1, {"Last-Event-ID": "zz9:5," + last_id})
    assert "zz9" not in parse_cursor(unknown[0][0])


def test_the_sdk_follows_a_cluster_across_an_apiserver_restart(
    two_edges: Cluster, url: str, spread: list[SyncSandbox]
) -> None:
    """client.follow_audit sends the stream's last id back when it reconnects: after
    the apiserver it followed is killed and started again, nothing comes twice."""
    ids = {sb.id for sb in spread}
    for sb in spread:
        sb.run_shell("reboot -f; true")
    with DSecSyncClient(url, two_edges.admin_key, timeout=60) as client:
        records = client.follow_audit(kinds=["event"])
        seen: list[tuple[str, int]] = []
        for r in records:
            seen.append((r.sandbox_id, r.seq))
            if ids <= {s for s, _ in seen}:
                break
        two_edges.apiservers[0].kill()
        two_edges.start_apiserver(0)
        spread[0].run_shell("reboot -f; true")
        before = max(q for s, q in seen if s == spread[0].id)
        after: list[tuple[str, int]] = []
        for r in records:
            after.append((r.sandbox_id, r.seq))
            if r.sandbox_id == spread[0].id and r.seq > before:
                break
    assert not set(after) & set(seen), "records repeated after the reconnect"
