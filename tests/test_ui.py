"""The /ui dashboard in a real headless Chromium (Debian's chromium + chromedriver,
driven by Selenium) against a real `dsec up`: login and refusal, a live table, live
plots (rates, latency percentiles), a sandbox's resource graphs, the misbehaviour feed,
job pause/resume, and hostile sandbox text shown as text.

Every test polls the page with a deadline (no fixed sleeps). Each page's screenshot is
written to docs/ui/ once the page shows what the test asked of it."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from dsec import DSecSyncClient
from dsec.sdk.sync import SyncSandbox
from tests.browser import (
    NEEDS_CHROMIUM,
    SHOTS,
    busybox_sandboxes,
    chromium,
    login,
    no_alert,
    refuses_without_a_session,
    shot,
    wait_for,
)
from tests.conftest import PlatformProcess, platform_process

pytest.importorskip("selenium")
from selenium import webdriver
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.root, NEEDS_CHROMIUM]

XSS_CMD = "echo '<img src=x onerror=alert(1)>'"
XSS_LABEL = "<script>window.__pwned=1</script><b>x</b>"


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        with DSecSyncClient(p.url, p.api_key) as c:
            c.build_image("busybox")
        yield p


@pytest.fixture(scope="module")
def api(plat: PlatformProcess) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(plat.url, plat.api_key) as c:
        yield c


@pytest.fixture
def sandboxes(api: DSecSyncClient) -> Iterator[Callable[..., SyncSandbox]]:
    with busybox_sandboxes(api) as make:
        yield make


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with chromium() as driver:
        yield driver


@pytest.fixture
def page(browser: webdriver.Chrome, plat: PlatformProcess) -> webdriver.Chrome:
    """The browser, logged in (``/ui?api_key=`` once, as an operator would)."""
    return login(browser, plat.url, plat.api_key)


def test_pages_refuse_without_a_session(browser: webdriver.Chrome, plat: PlatformProcess) -> None:
    refuses_without_a_session(browser, plat.url)
    shot(browser, "login")


def test_the_cookie_reads_and_pauses_but_nothing_more(
    plat: PlatformProcess, sandboxes: Callable[..., SyncSandbox]
) -> None:
    """HttpOnly + SameSite=Strict, not the key; GETs and CSRF-checked pause/resume only."""
    job = "ui-" + secrets.token_hex(4)
    sb = sandboxes(job_id=job)
    with httpx.Client(base_url=plat.url) as h:
        r = h.get("/ui", params={"api_key": plat.api_key})
        assert r.status_code == 303 and r.headers["location"] == "/ui"
        set_cookie = r.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie, set_cookie
        assert plat.api_key not in set_cookie
        token = r.cookies["dsec_ui"]
    with httpx.Client(base_url=plat.url, cookies={"dsec_ui": token}) as h:
        page = h.get("/ui")
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert h.get("/v1/sandboxes").status_code == 200
        assert h.get(f"/v1/audit?sandbox_id={sb.id}").status_code == 200
        other = sandboxes()  # a sandbox page's graphs read its own row only
        assert [r["id"] for r in h.get(f"/v1/stats?sandbox_id={sb.id}").json()] == [sb.id]
        assert h.get("/v1/stats?sandbox_id=nosuch").json() == []
        assert {sb.id, other.id} <= {r["id"] for r in h.get("/v1/stats").json()}
        # never a write beyond pause/resume, never one without the session's CSRF secret
        assert h.delete(f"/v1/sandboxes/{sb.id}").status_code == 401
        assert h.post("/v1/sandboxes", json={}).status_code == 401
        assert h.post(f"/v1/jobs/{job}/pause").status_code == 401
        csrf = h.get("/ui/session").json()["csrf"]
        assert h.post(f"/v1/jobs/{job}/pause", headers={"x-dsec-csrf": "x"}).status_code == 401
        bad = {"x-dsec-csrf": csrf, "origin": "http://evil.example"}
        assert h.post(f"/v1/jobs/{job}/pause", headers=bad).status_code == 401
        good = {"x-dsec-csrf": csrf, "origin": plat.url}
        assert h.post(f"/v1/jobs/{job}/pause", headers=good).status_code == 200
        assert h.post(f"/v1/jobs/{job}/resume", headers=good).status_code == 200
        # logging out ends the session server-side, whatever the browser keeps
        h.post("/ui/logout", headers={"origin": plat.url})
        h.cookies.set("dsec_ui", token)
        assert h.get("/v1/sandboxes").status_code == 401


def test_a_new_sandbox_appears_in_the_table(
    page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]
) -> None:
    page.get(page.current_url.split("/ui")[0] + "/ui")
    wait_for(
        "the table's first update", lambda: "updated" in page.find_element(By.ID, "status").text
    )
    t0 = time.monotonic()
    sb = sandboxes(labels={"team": "ui-test"}, job_id="ui-table")
    created = time.monotonic()
    row = wait_for(
        "the new sandbox's row",
        lambda: page.find_elements(By.CSS_SELECTOR, f'tr[data-id="{sb.id}"]'),
        timeout=5,
    )[0]
    seen = time.monotonic()
    assert seen - created < 2.5, (
        f"row after {seen - created:.2f}s (create took {created - t0:.2f}s)"
    )
    assert "running" in row.text and "busybox" in row.text and "ui-table" in row.text
    memory = f'tr[data-id="{sb.id}"] td:nth-child(9)'  # from /v1/stats
    wait_for("its memory", lambda: "iB" in page.find_element(By.CSS_SELECTOR, memory).text)
    # the job filter hides it, and showing it again needs no reload
    job = page.find_element(By.ID, "f-job")
    job.send_keys("no-such-job")
    wait_for(
        "the filter", lambda: not page.find_elements(By.CSS_SELECTOR, f'tr[data-id="{sb.id}"]')
    )
    job.clear()
    job.send_keys("ui-table")
    wait_for("the row back", lambda: page.find_elements(By.CSS_SELECTOR, f'tr[data-id="{sb.id}"]'))
    job.clear()
    job.send_keys(" ")  # an input event: every sandbox again
    wait_for("the row", lambda: page.find_elements(By.CSS_SELECTOR, f'tr[data-id="{sb.id}"]'))
    shot(page, "sandboxes")


def test_hostile_text_is_shown_as_text(
    page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]
) -> None:
    sb = sandboxes(labels={"note": XSS_LABEL}, job_id="ui-xss")
    r = sb.run_shell(XSS_CMD)
    assert r.exit_code == 0
    base = page.current_url.split("/ui")[0]
    page.get(base + "/ui")
    row = wait_for("the row", lambda: page.find_elements(By.CSS_SELECTOR, f'tr[data-id="{sb.id}"]'))
    assert XSS_LABEL in row[0].text
    page.get(base + "/ui/sandbox/" + sb.id)
    cmds = wait_for(
        "the command in the story",
        lambda: [
            c for c in page.find_elements(By.CSS_SELECTOR, "#commands td") if XSS_CMD in c.text
        ],
    )
    assert cmds
    assert XSS_LABEL in page.find_element(By.ID, "summary").text
    main = page.find_element(By.TAG_NAME, "main")
    assert not main.find_elements(By.TAG_NAME, "img")
    assert not main.find_elements(By.TAG_NAME, "script")
    assert not main.find_elements(By.CSS_SELECTOR, "dd b, td b")
    assert page.execute_script("return window.__pwned === undefined")
    assert no_alert(page)
    timeline = page.find_element(By.ID, "timeline").text
    assert "create" in timeline
    shot(page, "sandbox-text")


def plot_value(page: webdriver.Chrome, svg: str, attr: str = "data-last") -> float | None:
    """A plot's newest (or largest, ``data-max``) sample, None while it has none."""
    raw = page.find_element(By.ID, svg).get_attribute(attr)
    return float(raw) if raw else None


def test_a_sandbox_page_graphs_its_resources(
    page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]
) -> None:
    """Memory and CPU over time, from /v1/stats?sandbox_id= while the page is open."""
    sb = sandboxes(job_id="ui-resources")
    page.get(page.current_url.split("/ui")[0] + "/ui/sandbox/" + sb.id)
    wait_for("a memory sample", lambda: (plot_value(page, "plot-sb-memory") or 0) > 0)
    wait_for("a CPU sample", lambda: plot_value(page, "plot-sb-cpu") is not None)
    idle_cpu = plot_value(page, "plot-sb-cpu", "data-max") or 0.0
    line = "#plot-sb-memory polyline"
    points = page.find_element(By.CSS_SELECTOR, line).get_attribute("points")
    # a busy loop for 3 s: the CPU graph must see it (a loaded host still gives it a
    # good share of a core), and the memory graph must move on
    r = sb.run_shell("timeout 3 sh -c 'while :; do :; done'; echo burnt", timeout=30)
    assert r.stdout.strip() == "burnt"
    wait_for(
        "the busy loop in the CPU graph",
        lambda: (plot_value(page, "plot-sb-cpu", "data-max") or 0) > max(0.3, idle_cpu),
        timeout=5,
    )
    wait_for(
        "the memory graph to move",
        lambda: page.find_element(By.CSS_SELECTOR, line).get_attribute("points") != points,
        timeout=5,
    )
    assert "iB" in page.find_element(By.ID, "v-sb-memory").text
    wait_for(
        "the command in the story",
        lambda: [
            c for c in page.find_elements(By.CSS_SELECTOR, "#commands td") if "burnt" in c.text
        ],
    )
    shot(page, "sandbox")


def test_the_plot_updates(page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]) -> None:
    page.get(page.current_url.split("/ui")[0] + "/ui/plots")
    svg = "#plot-concurrent"

    def sample() -> tuple[int, str] | None:
        el = page.find_element(By.CSS_SELECTOR, svg)
        n = int(el.get_attribute("data-samples") or 0)
        return (n, el.get_attribute("data-last") or "") if n >= 2 else None

    _, before = wait_for("two samples", sample)
    sb = sandboxes()
    wait_for(
        "the plot to count the new sandbox",
        lambda: (
            float(page.find_element(By.CSS_SELECTOR, svg).get_attribute("data-last") or 0)
            > float(before)
        ),
        timeout=5,
    )
    points = page.find_element(By.CSS_SELECTOR, f"{svg} polyline").get_attribute("points")
    wait_for(
        "the polyline to move",
        lambda: (
            page.find_element(By.CSS_SELECTOR, f"{svg} polyline").get_attribute("points") != points
        ),
        timeout=5,
    )
    wait_for("a creates/s sample", lambda: page.find_element(By.ID, "v-creates").text != "-")
    # create and command latency p50/p99, from the histograms' buckets of the last 10 s
    p50 = wait_for("a create p50", lambda: plot_value(page, "plot-create-latency"), timeout=5)
    top = plot_value(page, "plot-create-latency", "data-max") or 0.0
    assert 0 < p50 < 60 and top >= p50
    caption = page.find_element(By.ID, "v-create-latency").text
    assert caption.startswith("p50 ") and "p99 " in caption, caption
    for _ in range(5):
        assert sb.run_shell("true").exit_code == 0
    wait_for("a command p50", lambda: plot_value(page, "plot-command-latency"), timeout=5)
    assert "ms" in page.find_element(By.ID, "v-command-latency").text
    shot(page, "plots")


def test_a_misbehaviour_event_appears_in_the_feed(
    page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]
) -> None:
    page.get(page.current_url.split("/ui")[0] + "/ui/feed")
    wait_for("the stream to open", lambda: "live" in page.find_element(By.ID, "feed-state").text)
    sb = sandboxes(job_id="ui-feed")
    sb.run_shell("reboot -f; true")

    def item() -> list[object]:
        return [
            li
            for li in page.find_elements(By.CSS_SELECTOR, "#feed li")
            if sb.id in li.text and "seccomp_violation" in li.text
        ]

    wait_for("the seccomp_violation event", item, timeout=10)
    shot(page, "feed")


def test_jobs_pause_and_resume_from_the_page(
    page: webdriver.Chrome, sandboxes: Callable[..., SyncSandbox]
) -> None:
    job = "ui-job-" + secrets.token_hex(3)
    sb = sandboxes(job_id=job)
    page.get(page.current_url.split("/ui")[0] + "/ui/jobs")
    row = f'tr[data-job="{job}"]'
    wait_for("the job's row", lambda: page.find_elements(By.CSS_SELECTOR, row))
    page.find_element(By.CSS_SELECTOR, f"{row} button.pause").click()
    wait_for(
        "the pause report",
        lambda: "pause:" in page.find_element(By.CSS_SELECTOR, f"{row} .result").text,
    )
    shot(page, "jobs")
    page.find_element(By.CSS_SELECTOR, f"{row} button.resume").click()
    wait_for(
        "the resume report",
        lambda: "resume:" in page.find_element(By.CSS_SELECTOR, f"{row} .result").text,
    )
    assert sb.run_shell("echo ok").stdout.strip() == "ok"


def test_screenshots_are_in_the_docs() -> None:
    """The committed set the README shows (refreshed by the tests above)."""
    for name in ("login", "sandboxes", "sandbox", "sandbox-text", "plots", "feed", "jobs"):
        assert (SHOTS / f"{name}.png").is_file(), name
