"""The debian-desktop VM image end to end (issue 17): built by the project
(dsec.guest.desktopimage, cached under $DSEC_CACHE_DIR after the first build: ~3 min
and ~250 MB of Debian packages), imported like ``dsec image import-vm``, booted under a
real `dsec up` (TCG here: ~40 s to the guest agent, ~60 s to the xterm), then driven as
a computer-use agent would: the guest agent runs a command, keys typed through QMP land
in the xterm (the command they spell runs in the guest), the screenshot changes and
has the display size X took from the VGA's EDID, and the live view's VNC server
reports that size too. The VM has network rules (fake services, tests/fakenet.py): the
image asks DHCP on eth0 like any OS booting from its own disk, the edge answers with the
slot's lease (dsec.net.dhcp), and the egress rules and DNS responder apply as for a
container: the allowed service answers, the denied one does not. Last, a snapshot of
that VM (its NIC and rules saved with it) starts without booting on a new slot: the
backend replugs its cable, networkd asks DHCP again and moves to the new address, and
the saved rules apply there. The image runs DSec's own agent (dsec-vminit --service as a
systemd unit, dsec.backends.fullvm.agentlink): sessions keep their state, a PTY and a
streamed command work as in a container, also after a job pause saved the VM to a
file and a request restored it, after its mux died (the unit restarts it, the host
links the new one), and after its service stayed down past the relink's wait (sessions
off, then back once the host sees the port open again). One boot for all.
Marked ``slow`` (it builds the Debian image).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from dsec import DSecSyncClient
from dsec.api.spec import DSecFullVMRunArgs
from dsec.backends.fullvm.machine import DEFAULT_DISPLAY
from dsec.errors import DSecError, Unsupported
from dsec.guest.desktopimage import build_desktop_image
from dsec.sdk.sync import SyncSandbox
from tests import waiting
from tests.conftest import PlatformProcess, platform_process
from tests.fakenet import FakeService, catalog, pypi_and_npm
from tests.rfb import Rfb

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None or shutil.which("debootstrap") is None,
        reason="QEMU and debootstrap are needed (scripts/install.sh installs them)",
    ),
]

BOOT = 600  # seconds to the guest agent under TCG on a loaded 2-core host
IMAGE = "debian-desktop:test"
SNAP = "debian-desktop-net:snap"
JOB = "desktop-test-job"
# Run a command in the guest a second from now, outside the agent's process tree. The
# accuracy matters: a transient timer's default AccuracySec is a minute, and systemd
# coalesced this one's firing by up to ~40 s (seen: sessions answered for 38 s after the
# "stop" was due), past what the tests wait for its effect.
LATER = ["systemd-run", "--on-active=1", "--timer-property=AccuracySec=100ms"]


@dataclass
class Desktop:
    plat: PlatformProcess
    client: DSecSyncClient
    sb: SyncSandbox
    pypi: FakeService
    npm: FakeService


@pytest.fixture(scope="module")
def desktop() -> Iterator[Desktop]:
    import asyncio

    t0 = time.monotonic()
    files = asyncio.run(build_desktop_image())
    print(f"debian-desktop image ready in {time.monotonic() - t0:.0f}s")
    with (
        pypi_and_npm() as (pypi, npm),
        tempfile.TemporaryDirectory(prefix="dsec-desktopcat-") as tmp,
    ):
        cat = catalog({"pypi": pypi, "npm": npm}, Path(tmp) / "catalog.json")
        with (
            platform_process(DSEC_BACKENDS="fullvm", DSEC_NETWORK_CATALOG=str(cat)) as plat,
            DSecSyncClient(plat.url, plat.api_key) as client,
        ):
            client.import_vm(
                IMAGE, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
            )
            spec = DSecFullVMRunArgs(
                vm_image=IMAGE,
                memory_limit_mb=1024,
                cpu_cores_limit=2,
                network_rules={"pypi": True, "npm": False},
                job_id=JOB,
            )
            t0 = time.monotonic()
            sb = client.run_fullvm(spec, timeout=BOOT)
            print(f"debian-desktop boot to guest agent: {time.monotonic() - t0:.1f}s")
            try:
                yield Desktop(plat, client, sb, pypi, npm)
            finally:
                with contextlib.suppress(DSecError):
                    sb.stop()


def pixels(png: bytes) -> bytes:
    """The PNG's decompressed scanlines (enough to tell a blank screen from a drawn one)."""
    data, pos = b"", 8
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos : pos + 8])
        if kind == b"IDAT":
            data += png[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return zlib.decompress(data)


# A guest probe is a command in a slow VM: asked once a second.
until = functools.partial(waiting.until, interval=1.0)


def test_the_desktop_boots_and_takes_typed_commands(desktop: Desktop) -> None:
    sb = desktop.sb
    assert sb.exec(["cat", "/etc/hostname"]).stdout == "dsec-desktop\n"
    t0 = time.monotonic()
    until("the xterm", lambda: sb.run_shell("pgrep -x xterm").exit_code == 0, 300)
    print(f"xterm running {time.monotonic() - t0:.1f}s after the guest agent answered")
    # X paints its black root first; the xterm (white, maximized by matchbox) comes later
    until("the xterm on the screen", lambda: b"\xff" in pixels(sb.screenshot()), 240)
    print(f"xterm on the screen {time.monotonic() - t0:.1f}s after the guest agent answered")
    before = sb.screenshot()
    assert struct.unpack(">II", before[16:24]) == DEFAULT_DISPLAY  # X took the EDID's mode
    # Keys reach the focused window only once the xterm is mapped: type until they land.
    deadline = time.monotonic() + 180
    while sb.run_shell("test -e /tmp/typed-in-xterm").exit_code != 0:
        assert time.monotonic() < deadline, "the typed command never ran in the xterm"
        sb.write("touch /tmp/typed-in-xterm")
        sb.press("enter")
        time.sleep(3)
    assert sb.screenshot() != before
    assert sb.run_shell("pgrep -x Xorg && pgrep -f matchbox-window-manager").exit_code == 0


def test_the_live_view_has_the_desktop_size(desktop: Desktop) -> None:
    resp = httpx.post(
        f"{desktop.plat.url}/v1/sandboxes/{desktop.sb.id}/token",
        headers={"Authorization": f"Bearer {desktop.plat.api_key}"},
        timeout=30,
    )
    token = resp.json()["token"]
    url = desktop.plat.url.replace("http://", "ws://")
    url += f"/v1/edge/sandboxes/{desktop.sb.id}/desktop/vnc?token={token}"
    with connect(url, max_size=None) as ws:
        rfb = Rfb(ws)
        width, height, bpp = rfb.handshake()
        assert (width, height) == DEFAULT_DISPLAY
        assert rfb.full_update(width, height, bpp) == width * height


def get(sb: SyncSandbox, host: str) -> tuple[int, str]:
    """GET http://host/ from the guest with bash's /dev/tcp (the name resolved through
    systemd-resolved, which asks the DNS server DHCP named); (exit code, body)."""
    cmd = (
        f"timeout 10 bash -c 'exec 3<>/dev/tcp/{host}/80 && "
        f'printf "GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n" >&3 && cat <&3\''
    )
    res = sb.run_shell(cmd, timeout=30)
    return res.exit_code, res.stdout.split("\r\n\r\n", 1)[-1] if res.exit_code == 0 else ""


def test_the_desktop_gets_its_network_by_dhcp(desktop: Desktop) -> None:
    sb = desktop.sb
    until(
        "eth0's DHCP lease",
        lambda: sb.run_shell("hostname -I").stdout.startswith("100."),
        120,
    )
    assert "nameserver" in sb.exec(["cat", "/etc/resolv.conf"]).stdout
    assert get(sb, "pypi.org") == (0, "fake-pypi")
    code, body = get(sb, "registry.npmjs.org")  # refused by the DNS responder
    assert code != 0 and body == ""
    code, body = get(sb, desktop.npm.ip)  # nor by address
    assert code != 0 and body == ""


def test_dsecs_agent_serves_sessions_a_pty_and_streams(desktop: Desktop) -> None:
    sb = desktop.sb
    session = sb.session()
    session.run("mkdir -p /tmp/proj && cd /tmp/proj && export X=41")
    assert session.run("pwd; echo $((X+1))").stdout == "/tmp/proj\n42\n"
    # commands go through the agent too: any user, not only qemu-ga's root
    assert sb.exec(["id", "-un"], user="nobody").stdout == "nobody\n"

    t0, first, chunks = time.monotonic(), None, []
    for chunk in sb.stream("echo first; sleep 3; echo second"):
        first = time.monotonic() - t0 if first is None else first
        chunks.append(chunk.data)
    assert b"".join(chunks) == b"first\nsecond\n"
    assert first is not None and first < time.monotonic() - t0 - 2  # before the end

    with sb.pty(rows=20, cols=70) as term:
        term.write("stty size; echo pty-$((6*7))\n")
        seen, deadline = b"", time.monotonic() + 30
        while b"pty-42" not in seen or b"20 70" not in seen:
            assert time.monotonic() < deadline, seen
            seen += term.read()
        term.write("exit 3\n")
        while term.read():
            pass
        assert term.exit is not None and term.exit.exit_code == 3


def test_dsecs_agent_comes_back_when_its_mux_dies(desktop: Desktop) -> None:
    """The guest's mux killed (outside the agent's process tree): the service restarts
    mux and agent, the host sees the port close and links the new mux."""
    sb = desktop.sb
    sb.exec([*LATER, "pkill", "-x", "dsec-vmmux"])
    t0 = time.monotonic()

    def back() -> bool:
        try:
            restarts = sb.session().run(
                "systemctl show -p NRestarts --value dsec-agent.service", timeout=10
            )
        except DSecError:
            return False  # the old link dropped under the request, or not linked yet
        return restarts.stdout == "1\n"

    until("the agent linked again", back, 90)
    print(f"agent back {time.monotonic() - t0:.1f}s after its mux was killed")


def test_dsecs_agent_survives_a_pause(desktop: Desktop) -> None:
    """Three pauses in a row, the first right after the mux restart above: a restored
    guest can read the new host's RESET before the EOF of the host its pause closed
    (port state and data travel on different virtqueues). The mux used to end the link
    on that EOF, dropping the HELLO it had queued: no answer, the session failed and
    sessions went off (1 run in ~5 here, nearly always on the first pause)."""
    sb = desktop.sb
    for round_ in range(3):
        session = sb.session()
        session.run(f"cd /etc && export Y={round_}")
        t0 = time.monotonic()
        report = desktop.client.pause_job(JOB)
        assert report.paused == 1, report
        assert sb.refresh().state.value == "paused"
        print(f"debian-desktop paused to its file in {time.monotonic() - t0:.1f}s")
        t0 = time.monotonic()
        # the session's request resumes the VM; the agent is linked again, state kept
        assert session.run("pwd; echo $Y").stdout == f"/etc\n{round_}\n"
        print(f"debian-desktop resumed for a session in {time.monotonic() - t0:.1f}s")
        assert sb.refresh().state.value == "running"
    assert [c.data for c in sb.stream("echo after")] == [b"after\n"]


def test_dsecs_agent_is_linked_again_when_its_service_comes_back_late(desktop: Desktop) -> None:
    """The agent service stopped for longer than a relink waits (15 s): the relink gives
    up and sessions turn off (a typed 501); when the service runs again, the host sees
    the port open and links it, and sessions come back without anyone asking.

    Stopped for 40 s: sessions are off from the give-up (~16 s) until the service is
    back, and a probe sent while the link was dropping can take its 10 s; with 25 s the
    window was ~10 s and a slow (software-emulated) guest let the probes miss it.
    (The flake that remained was systemd's: see LATER.)"""
    sb = desktop.sb
    sb.exec(
        [
            *LATER, "sh", "-c",
            "systemctl stop dsec-agent; sleep 40; systemctl start dsec-agent",
        ]
    )  # fmt: skip
    t0 = time.monotonic()

    def sessions_off() -> bool:
        try:
            sb.session().run("true", timeout=10)
        except Unsupported as exc:
            return exc.details.get("capability") == "sessions"
        except DSecError:
            pass  # the old link dropped under the request
        return False

    until("sessions off", sessions_off, 60)
    print(f"sessions off {time.monotonic() - t0:.1f}s after the service stopped")

    def sessions_back() -> bool:
        try:
            return sb.session().run("echo back", timeout=10).stdout == "back\n"
        except DSecError:
            return False

    until("sessions back", sessions_back, 90)
    print(f"sessions back {time.monotonic() - t0:.1f}s after the service stopped")


def test_a_snapshot_with_network_rules_starts_on_a_new_lease(desktop: Desktop) -> None:
    """Last in the module: a second VM beside the first."""
    old_ip = desktop.sb.run_shell("hostname -I").stdout.split()[0]
    t0 = time.monotonic()
    desktop.sb.snapshot(SNAP)
    print(f"debian-desktop snapshot: {time.monotonic() - t0:.1f}s")
    t0 = time.monotonic()
    # no rules in the spec: the saved ones apply
    spec = DSecFullVMRunArgs(vm_image=SNAP, memory_limit_mb=1024, cpu_cores_limit=2)
    with desktop.client.run_fullvm(spec, timeout=BOOT) as clone:
        print(f"debian-desktop start from snapshot: {time.monotonic() - t0:.1f}s")
        assert clone.info.spec.network_rules == {"pypi": True, "npm": False}
        # the restored guest's agent is linked anew (its old host end is gone)
        assert clone.session().run("echo $((2*21))").stdout == "42\n"

        def moved() -> bool:
            ips = clone.run_shell("hostname -I").stdout.split()
            return len(ips) == 1 and ips[0].startswith("100.") and ips[0] != old_ip

        until("the clone's new lease", moved, 120)
        print(f"new lease {time.monotonic() - t0:.1f}s after the start")
        assert get(clone, "pypi.org") == (0, "fake-pypi")
        code, body = get(clone, "registry.npmjs.org")
        assert code != 0 and body == ""
    # the first VM still has its own address and network
    assert desktop.sb.run_shell("hostname -I").stdout.split() == [old_ip]
    assert get(desktop.sb, "pypi.org") == (0, "fake-pypi")
