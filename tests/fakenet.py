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
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, A, DNSError, DNSRecord

from dsec.api.events import AuditKind, EventKind, Severity
from dsec.native import binary
from dsec.net.catalog import DEFAULT_SERVICES, Service
from dsec.net.dns import DnsServer, Resolved
from dsec.net.manager import NetworkManager
from dsec.net.netns import Slot

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


def dnsq_program() -> bytes:
    """The raw DNS client the tests copy into sandboxes (tests/adversary/dnsq.c), built
    static on the host once per source."""
    return binary(
        Path(__file__).parent / "adversary" / "dnsq.c",
        name="dnsq",
        subdir="tests",
        cflags=["-static", "-O1", "-w"],
        what="the DNS test client",
    ).read_bytes()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


OCTET_LOCKS = Path("/run/lock/dsec-tests-fakenet")


def octets_on_host() -> set[int]:
    """Third octets of the 198.18.0.0/16 addresses the host holds now."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "to", "198.18.0.0/16"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        int(a["local"].split(".")[2])
        for link in json.loads(out.stdout or "[]")
        for a in link.get("addr_info", [])
    }


def candidate_octets() -> list[int]:
    """The octets no host address uses, in a random order."""
    free = set(range(1, 256)) - octets_on_host()
    return sorted(free, key=lambda _: secrets.randbelow(1 << 16))


@contextlib.contextmanager
def service_octet() -> Iterator[int]:
    """A third octet for one test's fake services (198.18.<octet>.0/24) that no other
    test process uses while this is held.

    Why not a random one: two test workers that drew the same octet put the same
    gateway address on two host veths, and a destination another test took to be
    "nowhere" was the broadcast address of a service's /30 (seen in CI: a denial
    counted as host access). One lock file per octet, held with flock (a test run that
    died holds nothing), among the octets no host address uses."""
    OCTET_LOCKS.mkdir(parents=True, exist_ok=True)
    for octet in candidate_octets():
        fd = os.open(OCTET_LOCKS / str(octet), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield octet
        finally:
            os.close(fd)  # the lock goes with it
        return
    raise RuntimeError("every 198.18.<octet>.0/24 for fake services is in use")


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


@contextlib.contextmanager
def pypi_and_npm() -> Iterator[tuple[FakeService, FakeService]]:
    """The two fake registries the network tests use ("pypi", "npm"), on an octet no
    other test process holds (service_octet)."""
    with (
        service_octet() as octet,
        fake_service("pypi", octet, 0) as pypi,
        fake_service("npm", octet, 1) as npm,
    ):
        yield pypi, npm


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


# A record the fake resolver answers: (owner name, type "A"/"AAAA"/"CNAME", value, ttl).
FakeRecord = tuple[str, str, str, int]


class FakeResolver:
    """The edge's upstream resolver, faked: a UDP server on the host's loopback (the
    edge reaches it, sandboxes never do) that answers what a test sets and remembers
    every question it was asked, so a test can tell what left the edge.

    ``answers[name]`` is a list of answers, each a list of records; a query consumes
    the first while more than one is left (a TTL-0 rebinding returns a new answer to
    each query). Names below ``wildcards[suffix]`` get that answer; anything else is
    NXDOMAIN."""

    def __init__(self) -> None:
        self.answers: dict[str, list[list[FakeRecord]]] = {}
        self.wildcards: dict[str, list[FakeRecord]] = {}
        self.queries: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, *answers: list[FakeRecord]) -> None:
        with self._lock:
            self.answers[name] = [list(a) for a in answers]

    def asked(self, needle: str = "") -> list[str]:
        """Names asked so far that contain ``needle``."""
        with self._lock:
            return [name for name, _ in self.queries if needle in name]

    def _records(self, name: str) -> list[FakeRecord] | None:
        with self._lock:
            queue = self.answers.get(name)
            if queue:
                return queue.pop(0) if len(queue) > 1 else queue[0]
            for suffix, records in self.wildcards.items():
                if name.endswith("." + suffix):
                    return records
        return None

    def _serve(self) -> None:
        rdata = {"A": A, "AAAA": AAAA, "CNAME": CNAME}
        while True:
            try:
                data, addr = self._sock.recvfrom(65535)
            except OSError:
                return
            try:
                query = DNSRecord.parse(data)
            except DNSError:
                continue
            name = str(query.q.qname).rstrip(".")
            with self._lock:
                self.queries.append((name, str(QTYPE.get(query.q.qtype, query.q.qtype))))
            reply = query.reply()
            records = self._records(name.lower())
            if records is None:
                reply.header.rcode = RCODE.NXDOMAIN
            try:
                for owner, rtype, value, ttl in records or []:
                    rr = RR(owner, getattr(QTYPE, rtype), rdata=rdata[rtype](value), ttl=ttl)
                    reply.add_answer(rr)
            except (ValueError, DNSError):  # a test's typo: answer, and keep serving
                reply = query.reply()
                reply.header.rcode = RCODE.SERVFAIL
            with contextlib.suppress(OSError):
                self._sock.sendto(reply.pack(), addr)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def fake_resolver() -> Iterator[FakeResolver]:
    resolver = FakeResolver()
    try:
        yield resolver
    finally:
        resolver.close()


class StaticUpstream:
    """An in-process upstream for the responder (unit tests, bench): answers what
    ``records`` holds, remembers the names it was asked."""

    def __init__(self, records: dict[str, Resolved] | None = None) -> None:
        self.records: dict[str, Resolved] = dict(records or {})
        self.asked: list[str] = []

    async def resolve(self, name: str) -> Resolved:
        self.asked.append(name)
        return self.records.get(name, Resolved(()))


@dataclass
class RecordingAudit:
    """An audit sink that keeps what it is given (unit tests)."""

    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    events: list[tuple[EventKind, dict[str, Any]]] = field(default_factory=list)

    def record(self, sandbox_id: str, kind: AuditKind, action: str, **detail: Any) -> None:
        self.records.append((action, detail))

    def event(
        self, sandbox_id: str, kind: EventKind, *, severity: Severity | None = None, **detail: Any
    ) -> None:
        self.events.append((kind, detail))


@dataclass
class OfflineDns:
    """The edge's responder and DNS decisions in-process, for one registered sandbox,
    without nftables or sockets: ``ask`` goes through the same code as a datagram."""

    manager: NetworkManager
    server: DnsServer
    upstream: StaticUpstream
    audit: RecordingAudit
    source: str = "100.64.0.2"

    async def ask(self, name: str, qtype: str = "A") -> DNSRecord | None:
        reply = await self.server.answer(DNSRecord.question(name, qtype).pack(), self.source)
        return None if reply is None else DNSRecord.parse(reply)

    def sandbox(self) -> Any:
        return self.manager._by_ip[self.source]


def offline_dns(
    rules: dict[str, bool], services: dict[str, Service], upstream: StaticUpstream | None = None
) -> OfflineDns:
    audit = RecordingAudit()
    manager = NetworkManager(
        edge_id="offline",
        run_dir=Path("/nonexistent"),
        audit=audit,
        catalog={**DEFAULT_SERVICES, **services},
        upstream=("127.0.0.1", 9),
    )
    manager._exec.shutdown()
    manager._upstream = upstream = upstream or StaticUpstream()
    slot = Slot(idx=0, ifname="offline0", ip="100.64.0.2", gw="100.64.0.1")
    manager._register("sb-offline", slot, manager.check(rules))
    server = DnsServer(manager._resolve, lambda ip: ip in manager._by_ip)
    return OfflineDns(manager, server, upstream, audit)
