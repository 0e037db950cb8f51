"""Egress rules by service, for real: netns + veth + nftables + the edge's DNS responder.

Nothing leaves this machine: fake "pypi" and "npm" HTTP services run in their own
network namespaces (198.18.0.0/15, the benchmarking range), and a test catalog maps the
service names to them with static DNS answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import secrets
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.errors import InvalidArgument
from dsec.net.catalog import compile_rules, load_catalog
from dsec.security.events import AuditKind, EventKind
from tests.conftest import PlatformProcess, platform_process
from tests.fakenet import FakeService, fake_service

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

GET = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2"


@contextlib.contextmanager
def host_service() -> Iterator[int]:
    """An HTTP service of the host on 0.0.0.0 (answers ``host-ok``); yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"host-ok")

        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.ThreadingTCPServer(("0.0.0.0", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Net:
    platform: PlatformProcess
    pypi: FakeService
    npm: FakeService
    image: str


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    octet = secrets.randbelow(256)
    with (
        fake_service("pypi", octet, 0) as pypi,
        fake_service("npm", octet, 1) as npm,
        tempfile.TemporaryDirectory(prefix="dsec-netcat-") as tmp,
    ):
        catalog = Path(tmp) / "catalog.json"
        catalog.write_text(
            json.dumps(
                {
                    "services": {
                        "pypi": {
                            "hosts": ["pypi.org", "files.pythonhosted.org"],
                            "ports": [80],
                            "addresses": {
                                "pypi.org": [pypi.ip],
                                "files.pythonhosted.org": [pypi.ip],
                            },
                        },
                        "npm": {
                            "hosts": ["registry.npmjs.org"],
                            "ports": [80],
                            "addresses": {"registry.npmjs.org": [npm.ip]},
                        },
                    }
                }
            )
        )
        with platform_process(DSEC_NETWORK_CATALOG=str(catalog)) as plat:
            from dsec import DSecSyncClient

            with DSecSyncClient(plat.url, plat.api_key) as c:
                c.build_image("busybox")
            yield Net(plat, pypi, npm, "busybox:latest")


@pytest.fixture
async def nclient(net: Net) -> AsyncIterator[DSecClient]:
    c = DSecClient(net.platform.url, net.platform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


def spec(net: Net, rules: dict[str, bool], job: str | None = None) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image=net.image, network_rules=rules, memory_limit_mb=64, job_id=job
    )


async def fetch(sb: object, url: str) -> tuple[int, str]:
    """GET ``url`` with busybox nc (the static busybox's wget crashes without glibc's NSS
    modules in the image); a host name is resolved by the sandbox's DNS first. Returns
    (exit code, body)."""
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
    res = await sb.run_shell(cmd, timeout=20)  # type: ignore[attr-defined]
    head, sep, body = res.stdout.partition("\r\n\r\n")
    if res.exit_code != 0 or not sep or " 200 " not in head.split("\r\n")[0]:
        return res.exit_code or 1, res.stdout + res.stderr
    return 0, body.strip()


async def wait_for(predicate: object, what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not seen within {timeout}s: {what}")


def test_rules_are_validated_against_the_catalog() -> None:
    catalog = load_catalog(None)
    policy = compile_rules({"pypi": True, "npm": False, "10.0.0.0/8:80,443": True}, catalog)
    assert policy.lookup("pypi.org") == ((80, 80), (443, 443))
    assert policy.lookup("files.pythonhosted.org") is not None
    assert policy.lookup("registry.npmjs.org") is None
    assert ("10.0.0.0/8", (443, 443)) in policy.static
    gh = compile_rules({"github": True}, catalog)
    assert gh.lookup("objects.githubusercontent.com") and gh.lookup("x.githubusercontent.com")
    for bad in ("nosuchservice", "10.0.0.1/8", "10.0.0.300", "10.0.0.1:0", "10.0.0.1:9-2"):
        with pytest.raises(InvalidArgument):
            compile_rules({bad: True}, catalog)


async def test_allowed_service_by_name_denied_one_fails(net: Net, nclient: DSecClient) -> None:
    job = "netjob-" + secrets.token_hex(4)
    async with await nclient.run_container(
        spec(net, {"pypi": True, "npm": False}, job), timeout=60
    ) as sb:
        assert await fetch(sb, "http://pypi.org/") == (0, "fake-pypi")
        assert await fetch(sb, "http://files.pythonhosted.org/") == (0, "fake-pypi")
        # The denied service: its name does not resolve, and its address is dropped.
        res = await sb.run_shell("nslookup registry.npmjs.org", timeout=20)
        assert res.exit_code != 0 and "REFUSED" in (res.stdout + res.stderr).upper()
        code, _ = await fetch(sb, f"http://{net.npm.ip}/")
        assert code != 0
        # Unknown names are refused too; loopback always works.
        res = await sb.run_shell("nslookup example.com", timeout=20)
        assert res.exit_code != 0
        res = await sb.run_shell(
            "mkdir -p /tmp/w && echo lo-ok > /tmp/w/index.html && "
            "httpd -p 127.0.0.1:8080 -h /tmp/w",
            timeout=20,
        )
        assert await fetch(sb, "http://127.0.0.1:8080/index.html") == (0, "lo-ok")

        async def denied_event() -> bool:
            evs = await nclient.events(job=job, kinds=[EventKind.DENIED_CONNECTION])
            return any(e.detail.get("dst") == net.npm.ip for e in evs)

        await wait_for(denied_event, "a denied_connection event for the npm address")
        rows = await nclient.audit(job=job, kinds=[AuditKind.NETWORK], limit=10_000)
        actions = {(r.action, r.detail.get("name") or r.detail.get("dst")) for r in rows}
        assert ("dns_answered", "pypi.org") in actions
        assert ("dns_refused", "registry.npmjs.org") in actions
        assert ("connect_denied", net.npm.ip) in actions


async def test_update_network_replaces_rules(net: Net, nclient: DSecClient) -> None:
    """Setup phase may reach pypi, solve phase nothing; then npm only (replace, not merge)."""
    async with await nclient.run_container(spec(net, {"pypi": True}), timeout=60) as sb:
        assert await fetch(sb, "http://pypi.org/") == (0, "fake-pypi")
        durations = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert await sb.update_network({}) == {}
            durations.append(time.perf_counter() - t0)
            await sb.update_network({"pypi": True})
        print(f"update_network round trip p50 {sorted(durations)[2] * 1000:.2f} ms")
        assert sorted(durations)[2] < 0.1
        await sb.update_network({})
        code, _ = await fetch(sb, "http://pypi.org/")
        assert code != 0, "pypi still reachable after the rules were replaced by {}"
        assert await sb.update_network({"npm": True}) == {"npm": True}
        assert await fetch(sb, "http://registry.npmjs.org/") == (0, "fake-npm")
        code, _ = await fetch(sb, "http://pypi.org/")
        assert code != 0, "update merged instead of replacing"
        # Raw IP rules work by address, with ports.
        await sb.update_network({f"{net.pypi.ip}:80": True})
        assert await fetch(sb, f"http://{net.pypi.ip}/") == (0, "fake-pypi")
        with pytest.raises(InvalidArgument):
            await sb.update_network({"nosuchservice": True})
        with pytest.raises(InvalidArgument):
            await sb.update_network({"10.0.0.1/8": True})


async def test_host_metadata_and_other_sandboxes_unreachable(net: Net, nclient: DSecClient) -> None:
    job = "netjob-" + secrets.token_hex(4)
    port = net.platform.port
    async with (
        await nclient.run_container(spec(net, {"pypi": True}, job), timeout=60) as a,
        await nclient.run_container(spec(net, {"pypi": False}), timeout=60) as b,
    ):
        gw = (await a.run_shell("ip route | awk '/default/ {print $3}'")).stdout.strip()
        b_ip = (
            await b.run_shell(
                "ip -4 addr show eth0 | awk '/inet / {split($2,a,\"/\"); print a[1]}'"
            )
        ).stdout.strip()
        assert gw and b_ip
        await b.run_shell(
            "mkdir -p /tmp/w && echo b > /tmp/w/index.html && httpd -p 8080 -h /tmp/w"
        )
        assert (await fetch(a, f"http://{gw}:{port}/v1/health"))[0] != 0  # edge API via host
        assert (await fetch(a, "http://169.254.169.254/"))[0] != 0  # metadata
        assert (await fetch(a, f"http://{b_ip}:8080/index.html"))[0] != 0  # another sandbox
        assert (await fetch(a, "http://pypi.org/"))[1] == "fake-pypi"

        async def host_events() -> bool:
            evs = await nclient.events(job=job, kinds=[EventKind.HOST_ACCESS])
            return {"host", "metadata", "sandbox"} <= {e.detail.get("target") for e in evs}

        await wait_for(host_events, "host_access events for host, metadata and sandbox")
        with host_service() as host_port:  # a host service listening on every address
            assert (await fetch(a, f"http://{gw}:{host_port}/"))[0] != 0
            # Explicitly allowed, the other sandbox and the host are reachable.
            await a.update_network({f"{b_ip}:8080": True, "host": True})
            assert await fetch(a, f"http://{b_ip}:8080/") == (0, "b")
            assert await fetch(a, f"http://{gw}:{host_port}/") == (0, "host-ok")


async def test_sandbox_without_rules_has_loopback_only(net: Net, nclient: DSecClient) -> None:
    async with await nclient.run_container(
        DSecContainerRunArgs(container_image=net.image, memory_limit_mb=64), timeout=60
    ) as sb:
        links = (await sb.run_shell("ls /sys/class/net")).stdout.split()
        assert links == ["lo"]
        with pytest.raises(InvalidArgument, match="without network_rules"):
            await sb.update_network({"pypi": True})


def test_rules_survive_an_edge_restart(net: Net) -> None:
    """SIGKILL the platform: the sandbox keeps its network and rules; the new edge
    rebuilds its table and DNS, and a clean stop leaves nothing behind."""
    from dsec import DSecSyncClient

    plat = net.platform
    with DSecSyncClient(plat.url, plat.api_key) as c:
        sb = c.run_container(spec(net, {"npm": True}), timeout=60)
        res = sb.run_shell(f"nslookup registry.npmjs.org && {GET} {net.npm.ip} 80")
        assert res.stdout.endswith("fake-npm"), res.stdout + res.stderr
    plat.kill()
    plat.start()
    with DSecSyncClient(plat.url, plat.api_key) as c:
        sb = c.get(sb.id)
        assert sb.info.state.value == "running"
        # The address learnt from DNS before the restart is gone with the old table.
        res = sb.run_shell(f"nslookup registry.npmjs.org && {GET} {net.npm.ip} 80", timeout=20)
        assert res.stdout.endswith("fake-npm"), res.stdout + res.stderr
        res = sb.run_shell(f"{GET} {net.pypi.ip} 80", timeout=20)
        assert "fake-pypi" not in res.stdout
        sb.update_network({})
        res = sb.run_shell(f"{GET} {net.npm.ip} 80", timeout=20)
        assert "fake-npm" not in res.stdout
        sb.stop()


def test_cli_create_and_replace_rules(net: Net) -> None:
    env = {**os.environ, "DSEC_URL": net.platform.url, "DSEC_API_KEY": net.platform.api_key}
    dsec = [sys.executable, "-m", "dsec.cli.main"]

    def run(*args: str) -> str:
        p = subprocess.run([*dsec, *args], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    sid = run("sandbox", "create", "--image", net.image, "--allow", "pypi", "--deny", "npm")
    try:
        assert run("sandbox", "network", sid, "--allow", "npm") == "allowed: npm"
        assert json.loads(run("sandbox", "network", sid, "--json")) == {"network_rules": {}}
        bad = subprocess.run(
            [*dsec, "sandbox", "network", sid, "--allow", "nosuchservice"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "nosuchservice" in bad.stderr
    finally:
        run("sandbox", "rm", sid)
