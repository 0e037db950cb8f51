"""Headless Chromium for the dashboard's browser tests (tests/test_ui.py on `dsec up`,
tests/test_ui_cluster.py on a cluster's apiserver): Debian's chromium and
chromium-driver, driven by Selenium. One place for starting and always ending the
browser, logging in, waiting with a deadline and writing screenshots."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.sdk.sync import SyncSandbox
from tests.conftest import REPO
from tests.waiting import until

selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

NEEDS_CHROMIUM = pytest.mark.skipif(
    shutil.which("chromedriver") is None or shutil.which("chromium") is None,
    reason="needs Debian's chromium and chromium-driver (scripts/install.sh)",
)
SHOTS = REPO / "docs" / "ui"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 10.0) -> T:
    """Poll ``probe`` until it returns something truthy; an exception means the page
    is mid-render, so it is retried (and named if time runs out)."""
    return until(what, probe, timeout, retry_on=(Exception,))


@contextlib.contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """A headless Chromium; it, its chromedriver and its temporary files are gone
    afterwards, also on failure (with --disable-dev-shm-usage it keeps its shared memory
    in $TMPDIR, a directory of its own that it does not always remove)."""
    with tempfile.TemporaryDirectory(prefix="dsec-chromium-") as tmp:
        yield from _chromium(tmp)


def _chromium(tmp: str) -> Iterator[webdriver.Chrome]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
        "--no-first-run",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console_log() reads it
    service = Service(
        shutil.which("chromedriver") or "/usr/bin/chromedriver",
        env={**os.environ, "TMPDIR": tmp},  # chromedriver passes it on to the browser
    )
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            proc = service.process
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def login(browser: webdriver.Chrome, url: str, key: str) -> webdriver.Chrome:
    """Open ``/ui?api_key=`` once, as an operator would: the server sets the session
    cookie and sends the browser on to ``/ui`` (the key leaves the address bar)."""
    browser.get(url + "/ui?api_key=" + key)
    wait_for("the login redirect", lambda: browser.current_url == url + "/ui")
    return browser


def console_log(browser: webdriver.Chrome) -> str:
    """What the page wrote to its console and the errors it met (for a failure's message)."""
    try:
        entries = browser.get_log("browser")  # type: ignore[no-untyped-call]
    except Exception as exc:  # the browser is gone: say so, the failure is the news
        return f"(no console log: {exc})"
    return "\n".join(f"{e.get('level')} {e.get('message')}" for e in entries) or "(empty)"


def shot(browser: webdriver.Chrome, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / f"{name}.png"))


def no_alert(browser: webdriver.Chrome) -> bool:
    try:
        browser.switch_to.alert.dismiss()
    except NoAlertPresentException:
        return True
    return False


@contextlib.contextmanager
def busybox_sandboxes(api: DSecSyncClient) -> Iterator[Callable[..., SyncSandbox]]:
    """``make(**spec)`` creates a busybox sandbox; every one is stopped afterwards,
    also on failure."""
    made: list[SyncSandbox] = []

    def make(**kw: object) -> SyncSandbox:
        spec = DSecContainerRunArgs.model_validate(
            {"container_image": "busybox:latest", "memory_limit_mb": 64, **kw}
        )
        sb = api.run_container(spec)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sb.stop()


def refuses_without_a_session(browser: webdriver.Chrome, url: str) -> None:
    """Every page sends a browser without a session to the login form, a wrong key
    sets no cookie, and the routes the pages read answer 401 without a key or with a
    forged cookie."""
    browser.delete_all_cookies()
    for path in ("/ui", "/ui/plots", "/ui/jobs", "/ui/feed", "/ui/sandbox/x"):
        browser.get(url + path)
        wait_for(f"{path} to send us to the login form", lambda: "/ui/login" in browser.current_url)
        assert browser.find_elements(By.NAME, "api_key")
        assert not browser.find_elements(By.ID, "sandboxes")
    browser.get(url + "/ui?api_key=dsk_wrong")
    assert browser.find_elements(By.NAME, "api_key")
    assert not browser.get_cookies()
    reads = ("/v1/sandboxes", "/v1/stats", "/metrics", "/v1/audit", "/v1/events/stream")
    with httpx.Client(base_url=url, timeout=30) as h:
        assert h.get("/ui?api_key=dsk_wrong").status_code == 401
        assert h.get("/ui/session").status_code == 401
        for path in reads:
            assert h.get(path).status_code == 401, path
    with httpx.Client(base_url=url, cookies={"dsec_ui": "forged"}, timeout=30) as h:
        for path in reads:
            assert h.get(path).status_code == 401, path
        assert h.get("/ui/jobs").headers["location"] == "/ui/login"
