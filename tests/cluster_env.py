"""A whole cluster on this machine: PostgreSQL, apiservers, a watcher and edges, each
edge in its own network namespace with its own address on a test bridge.

Everything is a real process (`dsec apiserver`, `dsec watcher`, `dsec edge --join`)
started the way an operator would; the edges' leak checks are those of `dsec up`
(tests/conftest.host_leaks), and the bridge, veths and namespaces go away at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dsec import DSecSyncClient
from tests.conftest import clean_leftovers, host_leaks, kill_process, stop_process
from tests.pg import PostgresServer
from tests.ports import free_port


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class TestNet:
    """A bridge on the host (``.1``) and one namespace + veth per edge (``.10+i``)."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = field(default_factory=lambda: 100 + secrets.randbelow(100))
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"dsbr{self.tag}"

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.subnet}.1"

    def edge_ip(self, index: int) -> str:
        return f"10.213.{self.subnet}.{10 + index}"

    def __enter__(self) -> TestNet:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add_namespace(self, index: int) -> str:
        ns = f"dsec-{self.tag}-{index}"
        host_end, ns_end = f"dsv{self.tag}{index}", f"dsn{self.tag}{index}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("link", "set", ns_end, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{self.edge_ip(index)}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.host_ip)
        return ns

    def __exit__(self, *exc: object) -> None:
        for ns in self.namespaces:
            index = ns.rsplit("-", 1)[1]
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("link", "del", f"dsv{self.tag}{index}")  # the pair, at once
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", ns)
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("link", "del", self.bridge)

    def leftovers(self) -> list[str]:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        found = [f"link {self.bridge}"] if f" {self.bridge}:" in links else []
        found += [f"veth of {self.tag}" for line in links.splitlines() if f"dsv{self.tag}" in line]
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        found += [f"netns {n}" for n in self.namespaces if n in names]
        return found


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60.0) -> None:
        stop_process(self.proc, timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the process alone, as a crash (its sandboxes live on in the spawner)."""
        kill_process(self.proc)
        self.proc = None


def wait_healthy(url: str, proc: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not healthy in {timeout}s:\n{proc.tail()}")


@dataclass
class Edge:
    edge_id: str
    index: int
    url: str
    data_dir: Path
    proc: Proc


@dataclass
class Cluster:
    """``apiservers`` public URLs, ``edges`` by id; restartable parts for crash tests."""

    pg: PostgresServer
    net: TestNet
    base: Path
    db_url: str
    token: str = field(default_factory=lambda: "ct_" + secrets.token_hex(16))
    admin_key: str = field(default_factory=lambda: "dsk_admin_" + secrets.token_hex(12))
    apiservers: list[Proc] = field(default_factory=list)
    api_urls: list[str] = field(default_factory=list)
    watcher: Proc | None = None
    edges: dict[str, Edge] = field(default_factory=dict)

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["DSEC_CLUSTER_TOKEN"] = self.token
        env["XDG_CONFIG_HOME"] = str(self.base / "xdg")
        # Edges end their sandboxes on SIGTERM here, so the leak checks find nothing
        # (their default is to keep them for the next start: live restore).
        env.setdefault("DSEC_STOP_SANDBOXES_ON_EXIT", "1")
        env.update(extra)
        return env

    def start_apiserver(self, index: int | None = None) -> str:
        if index is None:
            index = len(self.apiservers)
            port = free_port()
            url = f"http://{self.net.host_ip}:{port}"
            self.api_urls.append(url)
            self.apiservers.append(Proc(f"apiserver{index}", [], self.base / f"api{index}.log", {}))
        url = self.api_urls[index]
        port = int(url.rsplit(":", 1)[1])
        proc = self.apiservers[index]
        proc.argv = [
            sys.executable, "-m", "dsec.cli.main", "apiserver",
            "--db", self.db_url, "--admin-key", self.admin_key,
            "--host", self.net.host_ip, "--port", str(port),
        ]  # fmt: skip
        proc.env = self._env()
        proc.start()
        wait_healthy(url, proc)
        return url

    def start_watcher(self) -> None:
        argv = [
            sys.executable, "-m", "dsec.cli.main", "watcher", "--db", self.db_url,
            "--period", "0.25", "--failures", "3", "--stale-after", "1.5",
        ]  # fmt: skip
        self.watcher = Proc("watcher", argv, self.base / "watcher.log", self._env())
        self.watcher.start()

    def add_edge(
        self,
        index: int,
        *,
        capacity: int,
        labels: dict[str, str] | None = None,
        network: bool = False,
    ) -> Edge:
        """``network``: sandboxes get networks (egress rules; the rollouts' model
        gateway); off by default, as most cluster tests need none."""
        ns = self.net.add_namespace(index)
        edge_id = f"c{self.net.tag}{index}"
        ip = self.net.edge_ip(index)
        data_dir = self.base / f"edge{index}"
        data_dir.mkdir()
        argv = [
            # nsenter, not `ip netns exec`: that remounts /sys in a private mount
            # namespace without the cgroup file systems the edge needs.
            "nsenter", f"--net=/run/netns/{ns}", "--",
            sys.executable, "-m", "dsec.cli.main", "edge",
            "--edge-id", edge_id, "--host", ip, "--port", "8471",
            "--data-dir", str(data_dir), "--max-sandboxes", str(capacity),
        ]  # fmt: skip
        for url in self.api_urls:
            argv += ["--join", url]
        for key, value in (labels or {}).items():
            argv += ["--label", f"{key}={value}"]
        proc = Proc(
            edge_id,
            argv,
            self.base / f"edge{index}.log",
            self._env(
                DSEC_NETWORK="1" if network else "0",
                DSEC_SANDBOX_DISK_GB="4",
                DSEC_EDGE_ID=edge_id,
            ),
        )
        edge = Edge(edge_id, index, f"http://{ip}:8471", data_dir, proc)
        self.edges[edge_id] = edge
        self.start_edge(edge)
        return edge

    def start_edge(self, edge: Edge) -> None:
        edge.proc.start()
        wait_healthy(edge.url, edge.proc, timeout=90)

    def wait_edges_up(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(f"{self.api_urls[0]}/v1/cluster/edges", headers=headers)
                if sum(1 for e in resp.json() if e["status"] == "up") >= count:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"fewer than {count} edges up after {timeout}s")

    def wait_edges_have(self, image: str, timeout: float = 30.0) -> None:
        """Until every edge's last report lists ``image``, plus one view refresh of the
        apiservers (0.25 s): placement filters on the images in its view."""
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(f"{self.api_urls[0]}/v1/cluster/edges", headers=headers)
                reports = {e["edge_id"]: e["report"]["images"] for e in resp.json()}
                if set(self.edges) <= reports.keys() and all(
                    image in reports[e] for e in self.edges
                ):
                    time.sleep(1.0)
                    return
            time.sleep(0.1)
        raise RuntimeError(f"not every edge reported {image} after {timeout}s")

    def log_tails(self) -> str:
        """Every process's own account, for a failure report (tests/conftest.py hook)."""
        procs = [*self.apiservers, self.watcher, *(e.proc for e in self.edges.values())]
        return "".join(f"--- {p.name} (running: {p.alive()}) ---\n{p.tail()}\n" for p in procs if p)

    def stop(self) -> list[str]:
        """Stop everything; return what leaked."""
        leaks: list[str] = []
        for edge in self.edges.values():
            edge.proc.stop()
            found = host_leaks(edge.data_dir, edge.edge_id)
            leaks += [f"{edge.edge_id}: {leak}" for leak in found]
            clean_leftovers(edge.data_dir, edge.edge_id)  # an edge killed by a test, too
        if self.watcher is not None:
            self.watcher.stop()
        for proc in self.apiservers:
            proc.stop()
        return leaks


@contextlib.contextmanager
def cluster(pg: PostgresServer, apiservers: int = 1) -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="dsec-cl-", dir="/tmp"))
    database = pg.create_database()
    leaks: list[str] = []
    net = TestNet()
    with net:
        c = Cluster(pg=pg, net=net, base=base, db_url=pg.url_for(database))
        try:
            for _ in range(apiservers):
                c.start_apiserver()
            c.start_watcher()
            yield c
        except BaseException:
            sys.stderr.write(c.log_tails())  # the base dir goes below
            raise
        finally:
            leaks = c.stop()
            pg.drop_database(database)
    leftovers = net.leftovers()
    assert not leaks, f"the cluster leaked: {leaks}"
    assert not leftovers, f"the test network was left behind: {leftovers}"
    shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def busybox_cluster(
    pg: PostgresServer,
    *,
    edges: int,
    apiservers: int,
    capacity: int = 20,
    network: bool = False,
) -> Iterator[Cluster]:
    """``cluster`` with ``edges`` edges that each have busybox and are up in the
    apiservers' placement view."""
    with cluster(pg, apiservers=apiservers) as c:
        for i in range(edges):
            c.add_edge(i, capacity=capacity, network=network)
        for edge in c.edges.values():
            with DSecSyncClient(edge.url, c.token) as client:
                client.build_image("busybox")
        c.wait_edges_up(edges)
        c.wait_edges_have("busybox:latest")  # placement filters on the images in its view
        yield c
