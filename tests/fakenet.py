"""Fake internet services for the tests, alone in their own network namespaces.

Nothing a test sends leaves this machine: a "pypi" or "npm" is an HTTP server in a
network namespace of its own (198.18.0.0/15, the benchmarking range), reached from the
host over a veth; a test catalog (``DSEC_NETWORK_CATALOG``) maps the service names to
it with static DNS answers. A service can also serve a directory, e.g. a PEP 503
package index with real wheels, so that `pip install` runs for real in a sandbox.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# socketserver, not http.server's HTTPServer: its server_bind() looks up the address's
# host name, which would hang (and send a DNS query) in a namespace without DNS.
SERVER = """
import http.server, os, socketserver, sys
body = sys.argv[2].encode()
root = sys.argv[3] if len(sys.argv) > 3 else None
class H(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **kw):
        super().__init__(*a, directory=root or "/nonexistent", **kw)
    def do_GET(self):
        if root is not None:
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer((sys.argv[1], 80), H).serve_forever()
"""


@dataclass
class FakeService:
    name: str
    netns: str
    host_if: str
    ip: str
    body: str
    proc: subprocess.Popen[bytes] | None = None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def fake_service(
    name: str, octet: int, index: int, root: Path | None = None
) -> Iterator[FakeService]:
    """An HTTP server on port 80 alone in its own netns, reachable from the host over a
    veth (198.18.<octet>.<4*index+2>): answers ``fake-<name>`` to everything, or serves
    the files under ``root``."""
    tag = secrets.token_hex(3)
    svc = FakeService(
        name=name,
        netns=f"dsec-fake-{name}-{tag}",
        host_if=f"fk{tag}{index}",
        ip=f"198.18.{octet}.{4 * index + 2}",
        body=f"fake-{name}",
    )
    gw = f"198.18.{octet}.{4 * index + 1}"
    try:
        _ip("netns", "add", svc.netns)
        _ip("link", "add", svc.host_if, "type", "veth", "peer", "name", "eth0", "netns", svc.netns)
        _ip("addr", "add", f"{gw}/30", "dev", svc.host_if)
        _ip("link", "set", svc.host_if, "up")
        for args in (
            ("link", "set", "lo", "up"),
            ("addr", "add", f"{svc.ip}/30", "dev", "eth0"),
            ("link", "set", "eth0", "up"),
            ("route", "add", "default", "via", gw),
        ):
            _ip("-n", svc.netns, *args)
        argv = [sys.executable, "-c", SERVER, svc.ip, svc.body]
        if root is not None:
            argv.append(str(root))
        svc.proc = subprocess.Popen(
            ["ip", "netns", "exec", svc.netns, *argv], start_new_session=True
        )
        deadline = time.monotonic() + 10
        while True:  # the host reaches it over the veth once it listens
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex((svc.ip, 80)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake {name} service did not start")
            time.sleep(0.05)
        yield svc
    finally:
        if svc.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait()
        subprocess.run(["ip", "link", "del", svc.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", svc.netns], capture_output=True)


def catalog(services: dict[str, FakeService], path: Path) -> Path:
    """A catalog file mapping each service name to its fake (port 80, static answers)."""
    hosts = {
        "pypi": ["pypi.org", "files.pythonhosted.org"],
        "npm": ["registry.npmjs.org"],
    }
    doc = {
        "services": {
            name: {
                "hosts": hosts.get(name, [f"{name}.example"]),
                "ports": [80],
                "addresses": {h: [svc.ip] for h in hosts.get(name, [f"{name}.example"])},
            }
            for name, svc in services.items()
        }
    }
    path.write_text(json.dumps(doc))
    return path


DEMO_PACKAGE = {
    "dsecdemo/__init__.py": "def add(a, b):\n    return a + b\n",
    "dsecdemo/test_add.py": (
        "import unittest\n\nfrom dsecdemo import add\n\n\n"
        "class AddTest(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    ),
    "dsecdemo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: dsecdemo\nVersion: 1.0\n",
    "dsecdemo-1.0.dist-info/WHEEL": (
        "Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    ),
}


def package_index(root: Path) -> Path:
    """A PEP 503 simple index holding one real wheel, ``dsecdemo`` 1.0 (with tests)."""
    wheel_name = "dsecdemo-1.0-py3-none-any.whl"
    (root / "packages").mkdir(parents=True)
    wheel = root / "packages" / wheel_name
    record = []
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in DEMO_PACKAGE.items():
            data = text.encode()
            zf.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name},sha256={digest.decode()},{len(data)}")
        record.append("dsecdemo-1.0.dist-info/RECORD,,")
        zf.writestr("dsecdemo-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    project = root / "simple" / "dsecdemo"
    project.mkdir(parents=True)
    (project / "index.html").write_text(
        f'<a href="/packages/{wheel_name}#sha256={sha}">{wheel_name}</a>\n'
    )
    return root
