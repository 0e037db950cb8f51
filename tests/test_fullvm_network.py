"""A full VM's network rules, end to end: a real `dsec up` with a catalog of two fake
services (tests/fakenet.py, each alone in its own network namespace), the project's
small VM image, and one q35 VM under TCG with ``network_rules`` booted for the module.

What is shown: the VM gets a virtio-net NIC on its slot's tap (dsec.net.vmtap: the
microVM's plumbing) and its address from the kernel command line; an allowed service
is reachable by name through the edge's DNS responder, a denied one is not (neither by
name nor by address), nor the host; ``update_network`` takes effect at once; a job
pause and the resume into a new QEMU hand the tap over again with the rules as last
set; a VM without rules has no NIC at all; a snapshot of a VM with rules keeps its NIC
and rules, and a VM started from it without rules gets them, on a new tap of its own
(this busybox guest keeps its static address: the new lease after the restore is shown
on debian-desktop, tests/test_fullvm_desktop.py); stop removes the tap
(tests/conftest.py leak-checks the rest).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecSyncClient
from dsec.api.spec import DSecFullVMRunArgs
from dsec.errors import DSecError
from dsec.guest.vmimage import busybox_vm_image
from dsec.net.vmtap import is_tap
from dsec.sdk.sync import SyncSandbox
from tests.conftest import PlatformProcess, platform_process, qemus
from tests.fakenet import FakeService, pypi_and_npm
from tests.fullvm_env import BOOT, FULLVM_MARKS
from tests.test_network import host_service

pytestmark = FULLVM_MARKS

IMAGE = "fvm-net:1"
JOB = "fvm-net-job"


@dataclass
class Net:
    plat: PlatformProcess
    client: DSecSyncClient
    sb: SyncSandbox
    pypi: FakeService
    npm: FakeService


def _catalog(path: Path, pypi: FakeService, npm: FakeService) -> None:
    services = {
        "pypi": {"hosts": ["pypi.org"], "ports": [80], "addresses": {"pypi.org": [pypi.ip]}},
        "npm": {
            "hosts": ["registry.npmjs.org"],
            "ports": [80],
            "addresses": {"registry.npmjs.org": [npm.ip]},
        },
    }
    path.write_text(json.dumps({"services": services}))


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    files = busybox_vm_image()
    with (
        pypi_and_npm() as (pypi, npm),
        tempfile.TemporaryDirectory(prefix="dsec-fvmcat-") as tmp,
    ):
        catalog = Path(tmp) / "catalog.json"
        _catalog(catalog, pypi, npm)
        with (
            platform_process(DSEC_BACKENDS="fullvm", DSEC_NETWORK_CATALOG=str(catalog)) as plat,
            DSecSyncClient(plat.url, plat.api_key) as client,
        ):
            client.import_vm(
                IMAGE, files.disk, kernel=files.kernel, initrd=files.initrd, cmdline=files.cmdline
            )
            spec = DSecFullVMRunArgs(
                vm_image=IMAGE,
                memory_limit_mb=256,
                network_rules={"pypi": True, "npm": False},
                job_id=JOB,
            )
            sb = client.run_fullvm(spec, timeout=BOOT)
            try:
                yield Net(plat, client, sb, pypi, npm)
            finally:
                with contextlib.suppress(DSecError):
                    sb.stop()


def fetch(sb: SyncSandbox, url: str) -> tuple[int, str]:
    """GET ``url`` with busybox nc; a host name is resolved by the sandbox's DNS first
    (as tests/test_network.py's ``fetch``, synchronously)."""
    hostport, _, path = url.split("//", 1)[1].partition("/")
    host, _, port = hostport.partition(":")
    get = f"printf 'GET /{path} HTTP/1.0\\r\\n\\r\\n' | nc -w 2"
    if host[0].isdigit():
        cmd = f"{get} {host} {port or 80}"
    else:
        cmd = (
            f"ip=$(nslookup {host} | awk '/^Address/ {{a=$NF}} END {{print a}}') && "
            f'[ -n "$ip" ] && {get} "$ip" {port or 80}'
        )
    res = sb.run_shell(cmd, timeout=20)
    body = res.stdout.split("\r\n\r\n", 1)[-1] if res.exit_code == 0 else ""
    return res.exit_code, body


def test_allowed_is_reachable_denied_is_not_and_updates_take_effect(net: Net) -> None:
    sb = net.sb
    links = sb.run_shell("ls /sys/class/net").stdout.split()
    assert sorted(links) == ["eth0", "lo"]
    assert fetch(sb, "http://pypi.org/") == (0, "fake-pypi")
    assert fetch(sb, f"http://{net.npm.ip}/")[0] != 0
    assert sb.run_shell("nslookup registry.npmjs.org", timeout=20).exit_code != 0
    gw = sb.run_shell("ip route | awk '/default/ {print $3}'").stdout.strip()
    assert gw
    with host_service() as port:
        assert fetch(sb, f"http://{gw}:{port}/")[0] != 0
    assert sb.update_network({}) == {}
    assert fetch(sb, "http://pypi.org/")[0] != 0
    assert sb.update_network({"npm": True}) == {"npm": True}
    assert fetch(sb, "http://registry.npmjs.org/") == (0, "fake-npm")
    assert fetch(sb, f"http://{net.pypi.ip}/")[0] != 0


def test_a_paused_vm_resumes_with_its_network(net: Net) -> None:
    before = qemus(net.plat.data_dir)
    assert net.client.pause_job(JOB).paused == 1
    assert qemus(net.plat.data_dir) == []
    assert fetch(net.sb, "http://registry.npmjs.org/") == (0, "fake-npm")
    assert fetch(net.sb, f"http://{net.pypi.ip}/")[0] != 0
    assert qemus(net.plat.data_dir) != before


def test_a_vm_without_rules_has_no_nic(net: Net) -> None:
    spec = DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=256)
    with net.client.run_fullvm(spec, timeout=BOOT) as plain:
        assert plain.run_shell("ls /sys/class/net").stdout.split() == ["lo"]


def test_a_snapshot_keeps_its_nic_and_rules(net: Net) -> None:
    net.sb.snapshot("fvm-net-snap:1")
    assert net.sb.run_shell("echo alive").stdout == "alive\n"
    rules = net.sb.refresh().spec.network_rules
    spec = DSecFullVMRunArgs(vm_image="fvm-net-snap:1", memory_limit_mb=256)
    with net.client.run_fullvm(spec, timeout=BOOT) as clone:
        assert clone.info.spec.network_rules == rules  # the saved rules
        assert len(_taps(net.plat.edge_id)) == 2  # a slot of its own
        assert clone.run_shell("ls /sys/class/net").stdout.split() == ["eth0", "lo"]
    deadline = time.monotonic() + 10  # the manager deletes the clone's tap off its loop
    while len(_taps(net.plat.edge_id)) != 1:
        assert time.monotonic() < deadline, "the clone's tap outlived it"
        time.sleep(0.1)


def _taps(edge_id: str) -> list[str]:
    """The taps of the platform's edge (dsec.net.manager names them <prefix><slot>)."""
    prefix = "d" + hashlib.sha1(edge_id.encode()).hexdigest()[:5]
    return [
        d.name
        for d in Path("/sys/class/net").iterdir()
        if d.name.startswith(prefix) and is_tap(d.name)
    ]


def test_stop_removes_the_tap(net: Net) -> None:
    assert len(_taps(net.plat.edge_id)) == 1
    net.sb.stop()
    assert qemus(net.plat.data_dir) == []
    deadline = time.monotonic() + 10  # the manager deletes the tap off its event loop
    while _taps(net.plat.edge_id):
        assert time.monotonic() < deadline, "the tap outlived its sandbox"
        time.sleep(0.1)
