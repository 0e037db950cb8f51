"""The live view of a full VM end to end: QEMU's VNC server on a unix socket in the VM's
directory, relayed by the edge as a WebSocket on the data path, and shown by the
dashboard's noVNC page. One VM (the project's small test image, its 720x400 VGA text
console) is booted for the module under a real `dsec up`.

What is shown: an RFB client in Python reaches "RFB 003.008" through the WebSocket with
the sandbox's token, passes the "None" security type and gets a full framebuffer update
of the VM's screen size; a wrong token, another sandbox's token and no token are refused
before the upgrade; a fifth viewer is refused (429) while four are open; the headless
Chromium page draws the screen into a canvas of that size; and a VM that stops closes
the socket of a viewer still attached.
"""

from __future__ import annotations

import contextlib
import shutil
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from dsec import DSecSyncClient
from dsec.api.spec import DSecFullVMRunArgs
from dsec.apiserver.ui import novnc_file
from dsec.edge.liveview import MAX_VIEWERS
from dsec.errors import DSecError
from dsec.guest.vmimage import busybox_vm_image
from dsec.sdk.sync import SyncSandbox
from tests.conftest import PlatformProcess, platform_process
from tests.fullvm_env import BOOT, FULLVM_MARKS
from tests.rfb import Rfb

pytestmark = FULLVM_MARKS

IMAGE = "fvm-vnc:1"
SCREEN = (720, 400)  # the test image's VGA text console (SeaBIOS)


@dataclass
class VM:
    plat: PlatformProcess
    client: DSecSyncClient
    sb: SyncSandbox

    def ws_url(self, sandbox_id: str | None = None) -> str:
        sid = sandbox_id or self.sb.id
        return self.plat.url.replace("http://", "ws://") + f"/v1/edge/sandboxes/{sid}/desktop/vnc"

    def token(self) -> str:
        """A fresh data-path token for the VM, as the SDK and the page get one."""
        resp = httpx.post(
            f"{self.plat.url}/v1/sandboxes/{self.sb.id}/token",
            headers={"Authorization": f"Bearer {self.plat.api_key}"},
            timeout=30,
        )
        resp.raise_for_status()
        token: str = resp.json()["token"]
        return token


@pytest.fixture(scope="module")
def vm() -> Iterator[VM]:
    files = busybox_vm_image()
    with (
        platform_process(DSEC_BACKENDS="fullvm") as plat,
        DSecSyncClient(plat.url, plat.api_key) as client,
    ):
        client.import_vm(
            IMAGE, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
        )
        spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256)
        sb = client.run_fullvm(spec, timeout=BOOT)
        try:
            yield VM(plat, client, sb)
        finally:
            with contextlib.suppress(DSecError):
                sb.stop()


def test_rfb_through_the_websocket_gets_the_screen(vm: VM) -> None:
    t0 = time.monotonic()
    with connect(vm.ws_url() + "?token=" + vm.token(), max_size=None) as ws:
        rfb = Rfb(ws)
        width, height, bpp = rfb.handshake()
        assert (width, height) == SCREEN
        png = vm.sb.screenshot()  # the same display QMP reads
        assert struct.unpack(">II", png[16:24]) == SCREEN
        assert rfb.full_update(width, height, bpp) == width * height
    print(f"RFB handshake and a full {width}x{height} update: {time.monotonic() - t0:.2f}s")
    # the header works too (an SDK or a proxy)
    auth = {"Authorization": f"Bearer {vm.token()}"}
    with connect(vm.ws_url(), additional_headers=auth) as ws:
        assert Rfb(ws).read(12) == b"RFB 003.008\n"


def test_a_wrong_token_is_refused_before_the_upgrade(vm: VM) -> None:
    token = vm.token()
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    for url, status in (
        (vm.ws_url(), 401),  # no credential
        (vm.ws_url() + "?token=" + forged, 401),
        (vm.ws_url() + "?token=dsk_not_a_key", 401),
        (vm.ws_url(vm.plat.edge_id + "-0123456789abcdef") + "?token=" + token, 403),
    ):
        with pytest.raises(InvalidStatus) as err, connect(url):
            pass
        assert err.value.response.status_code == status, url


def test_viewers_are_bounded(vm: VM) -> None:
    url = vm.ws_url() + "?token=" + vm.token()
    with contextlib.ExitStack() as stack:
        for _ in range(MAX_VIEWERS):
            ws = stack.enter_context(connect(url))
            assert Rfb(ws).read(12) == b"RFB 003.008\n"
        with pytest.raises(InvalidStatus) as err, connect(url):
            pass
        assert err.value.response.status_code == 429
        assert b"too_many_viewers" in err.value.response.body
    # closed viewers give their places back
    deadline = time.monotonic() + 10
    while True:
        try:
            with connect(url) as ws:
                assert Rfb(ws).read(12) == b"RFB 003.008\n"
            break
        except InvalidStatus:
            assert time.monotonic() < deadline, "closed viewers were not released"
            time.sleep(0.1)


@pytest.fixture
def browser_mod() -> ModuleType:
    """tests.browser, or a skip where Debian's Chromium is not installed."""
    mod: ModuleType = pytest.importorskip("tests.browser")
    if shutil.which("chromedriver") is None or shutil.which("chromium") is None:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/install.sh)")
    return mod


def connected(browser_mod: ModuleType, browser: Any) -> None:
    """Wait until the live view page says it is connected: each attempt has a 15 s
    deadline and the page makes five (desktop.js); on failure, say what the page said,
    what its console said and which requests it made."""
    from selenium.webdriver.common.by import By

    body = browser.find_element(By.TAG_NAME, "body")
    try:
        browser_mod.wait_for(
            "noVNC to connect", lambda: body.get_attribute("data-vnc") == "connected", 120
        )
    except AssertionError as exc:
        status = browser.find_element(By.ID, "status").text
        log = browser_mod.console_log(browser)
        loaded = browser.execute_script(
            "return performance.getEntries().map(e => e.name + ' ' + Math.round(e.duration)"
            " + 'ms ' + (e.responseStatus || ''))"
        )
        raise AssertionError(
            f"{exc}; the page says {status!r}; console:\n{log}\nloaded: {loaded}"
        ) from None


def test_the_novnc_page_draws_the_screen(vm: VM, browser_mod: ModuleType) -> None:
    from selenium.webdriver.common.by import By

    url = vm.sb.vnc_url()
    assert url == f"{vm.plat.url}/ui/desktop/{vm.sb.id}"
    with browser_mod.chromium() as browser:
        browser_mod.login(browser, vm.plat.url, vm.plat.api_key)
        browser.get(f"{vm.plat.url}/ui/sandbox/{vm.sb.id}")  # the sandbox's page links it
        link = browser_mod.wait_for(
            "the live view link", lambda: browser.find_element(By.ID, "live-view")
        )
        assert link.get_attribute("href") == url
        t0 = time.monotonic()
        browser.get(url)
        connected(browser_mod, browser)
        size = browser_mod.wait_for(
            "a canvas of the VM's screen size",
            lambda: browser.execute_script(
                "const c = document.querySelector('#screen canvas');"
                "return c && c.width === 720 && c.height === 400 ? [c.width, c.height] : null;"
            ),
            timeout=30,
        )
        assert tuple(size) == SCREEN
        # the cookie mints the page's view-only token, only with the session's CSRF
        # secret, and never a full data-path token; the view token opens the live view
        # and nothing else
        cookie = {"dsec_ui": browser.get_cookie("dsec_ui")["value"]}
        with httpx.Client(base_url=vm.plat.url, cookies=cookie, timeout=30) as h:
            view_path = f"/v1/sandboxes/{vm.sb.id}/view-token"
            assert h.post(view_path).status_code == 401
            csrf = h.get("/ui/session").json()["csrf"]
            csrf_header = {"X-DSec-CSRF": csrf}
            full = h.post(f"/v1/sandboxes/{vm.sb.id}/token", headers=csrf_header)
            assert full.status_code == 401
            minted = h.post(view_path, headers=csrf_header)
            assert minted.status_code == 200
            view = minted.json()["token"]
            assert view.startswith("dsv1.")
        with connect(vm.ws_url() + "?token=" + view) as ws:
            assert Rfb(ws).read(12) == b"RFB 003.008\n"
        shot = httpx.get(
            f"{vm.plat.url}/v1/edge/sandboxes/{vm.sb.id}/desktop/screenshot",
            headers={"Authorization": f"Bearer {view}"},
            timeout=30,
        )
        assert shot.status_code == 403 and shot.json()["error"]["code"] == "permission_denied"
        attempts = browser.find_element(By.TAG_NAME, "body").get_attribute("data-attempts")
        print(f"noVNC connected ({attempts} attempt) and drew {size}: {time.monotonic() - t0:.2f}s")
        browser_mod.shot(browser, "desktop")


def test_the_novnc_page_tries_again_while_the_viewers_are_full(
    vm: VM, browser_mod: ModuleType
) -> None:
    """The page's first attempts are refused (every viewer place is taken): it says so
    and tries again, and connects once a place is free."""
    from selenium.webdriver.common.by import By

    url = vm.ws_url() + "?token=" + vm.token()
    with browser_mod.chromium() as browser, contextlib.ExitStack() as viewers:
        for _ in range(MAX_VIEWERS):
            assert Rfb(viewers.enter_context(connect(url))).read(12) == b"RFB 003.008\n"
        browser_mod.login(browser, vm.plat.url, vm.plat.api_key)
        browser.get(vm.sb.vnc_url())
        body = browser.find_element(By.TAG_NAME, "body")
        browser_mod.wait_for(
            "the page to try again", lambda: body.get_attribute("data-vnc") == "retrying", 30
        )
        status = browser.find_element(By.ID, "status").text
        assert "refused or lost" in status and "attempt 2" in status, status
        viewers.close()
        connected(browser_mod, browser)
        assert int(body.get_attribute("data-attempts") or 0) >= 2


def test_only_novnc_modules_are_served() -> None:
    assert novnc_file("core/rfb.js") is not None, "noVNC is not vendored: scripts/install.sh"
    for name in ("../ui.py", "core/../../ui.py", "core/rfb.js.map", "LICENSE.txt", "core/.x.js"):
        assert novnc_file(name) is None, name


def test_a_stopped_vm_closes_its_viewers(vm: VM) -> None:
    """Last in the module: it stops the VM."""
    with connect(vm.ws_url() + "?token=" + vm.token()) as ws:
        assert Rfb(ws).read(12) == b"RFB 003.008\n"
        vm.sb.stop()
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
