"""The /ui dashboard served by a cluster's apiserver, in a real headless Chromium: a
real PostgreSQL, an apiserver, a watcher and two edges in their own network namespaces
(tests/cluster_env.py). The pages read the apiserver only: the sandbox table (the
edges' lists merged), a sandbox's story (its audit, from its edge), the misbehaviour
feed (every edge's records fanned in as one stream whose event ids are cursors over
the edges), the plots (the apiserver's own /metrics: what it does not count reads
n/a) and job pause/resume (fanned out to the edges), behind the same auth as one node.
"""

from __future__ import annotations

import functools
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
from tests.browser import (
    NEEDS_CHROMIUM,
    busybox_sandboxes,
    chromium,
    login,
    no_alert,
    refuses_without_a_session,
    shot,
    wait_for,
)
from tests.cluster_env import Cluster, busybox_cluster
from tests.pg import PostgresServer

pytest.importorskip("selenium")
from selenium import webdriver
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.root, NEEDS_CHROMIUM, pytest.mark.timeout(300)]

Frame = tuple[str, dict[str, object]]  # (the SSE id, the record)


@pytest.fixture(scope="module")
def two_edges(postgres: PostgresServer) -> Iterator[Cluster]:
    with busybox_cluster(postgres, edges=2, apiservers=1, capacity=10) as c:
        yield c


@pytest.fixture(scope="module")
def url(two_edges: Cluster) -> str:
    return two_edges.api_urls[0]


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with chromium() as driver:
        yield driver


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


def text_of(page: webdriver.Chrome, css: str) -> str:
    """The text of the first element matching ``css``; "" while there is none."""
    found = page.find_elements(By.CSS_SELECTOR, css)
    return str(found[0].text) if found else ""


def test_pages_refuse_without_a_session(browser: webdriver.Chrome, url: str) -> None:
    refuses_without_a_session(browser, url)


def test_the_cookie_reaches_the_pages_reads_only(two_edges: Cluster, url: str) -> None:
    """As on one node: HttpOnly, SameSite=Strict, not the key; reads the pages make,
    never the cluster's own routes or a write without the session's CSRF secret."""
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.get("/ui", params={"api_key": two_edges.admin_key})
        assert r.status_code == 303 and r.headers["location"] == "/ui"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert two_edges.admin_key not in cookie
        assert "script-src 'self'" in h.get("/ui").headers["content-security-policy"]
        for path in ("/v1/sandboxes", "/v1/stats", "/metrics", "/v1/health", "/v1/audit"):
            assert h.get(path).status_code == 200, path
        assert h.get("/v1/cluster/edges").status_code == 401
        assert h.post("/v1/sandboxes", json={}).status_code == 401
        assert h.post("/v1/jobs/j/pause").status_code == 401  # no CSRF header
        session = h.get("/ui/session").json()
        assert session["job_control"] is True
        ok = {"x-dsec-csrf": session["csrf"], "origin": url}
        assert h.post("/v1/jobs/j/pause", headers=ok).status_code == 200


def test_table_story_feed_plots_and_jobs(
    browser: webdriver.Chrome, two_edges: Cluster, url: str, spread: list[SyncSandbox]
) -> None:
    page = login(browser, url, two_edges.admin_key)
    for sb in spread:
        assert sb.run_shell(f"echo story-of-{sb.id}").exit_code == 0
        sb.run_shell("reboot -f; true")  # seccomp_violation, on each edge

    # the table: the edges' sandboxes, merged by the apiserver
    for sb in spread:
        css = f'tr[data-id="{sb.id}"]'
        row = wait_for(f"{sb.id}'s row", functools.partial(text_of, page, css))
        assert "running" in row and "busybox" in row
    memory = f'tr[data-id="{spread[1].id}"] td:nth-child(9)'  # /v1/stats, from its edge
    wait_for("its memory", lambda: "iB" in text_of(page, memory))

    # a sandbox's story: its audit, read from its edge through the apiserver
    sb = spread[1]
    page.get(url + "/ui/sandbox/" + sb.id)
    wait_for("its command", lambda: f"story-of-{sb.id}" in text_of(page, "#commands tbody"))
    assert "create" in text_of(page, "#timeline")
    wait_for("its event", lambda: "seccomp_violation" in text_of(page, "#events"))

    # the misbehaviour feed: both edges' events in one stream
    page.get(url + "/ui/feed")

    def feed_has(sandbox: SyncSandbox) -> bool:
        return any(
            sandbox.id in li.text and "seccomp_violation" in li.text
            for li in page.find_elements(By.CSS_SELECTOR, "#feed li")
        )

    wait_for("the stream to open", lambda: "live" in text_of(page, "#feed-state"))
    wait_for("both edges' events in the feed", lambda: all(feed_has(s) for s in spread))
    assert no_alert(page)

    # the plots: the creates this apiserver placed; commands are counted on the edges
    page.get(url + "/ui/plots")
    wait_for("the cluster note", lambda: page.find_element(By.ID, "cluster-note").is_displayed())
    wait_for("a creates/s sample", lambda: text_of(page, "#v-creates") not in ("", "-", "n/a"))
    assert text_of(page, "#v-commands") == "n/a"
    assert page.find_element(By.ID, "plot-commands").get_attribute("data-na") == "true"
    assert text_of(page, "#v-command-latency") == "n/a"
    assert text_of(page, "#v-create-latency") != "n/a"  # counted here (none in the window)
    shot(page, "cluster-plots")

    # job pause/resume through the apiserver, fanned out to the edges
    job = spread[0].info.spec.job_id
    page.get(url + "/ui/jobs")
    row = f'tr[data-job="{job}"]'
    wait_for("the job's row", lambda: page.find_elements(By.CSS_SELECTOR, f"{row} button.pause"))
    assert not page.find_element(By.ID, "no-job-control").is_displayed()
    page.find_element(By.CSS_SELECTOR, f"{row} button.pause").click()
    wait_for("the pause report", lambda: "paused=2" in text_of(page, f"{row} .result"))
    page.find_element(By.CSS_SELECTOR, f"{row} button.resume").click()
    wait_for("the resume report", lambda: "resumed=2" in text_of(page, f"{row} .result"))
    assert spread[0].run_shell("echo ok").stdout.strip() == "ok"


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
