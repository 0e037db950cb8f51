"""/metrics, scraped by a real Prometheus server (Debian's `prometheus`, started here).

The platform runs sandboxes (a create, commands, a failed create, a stop); Prometheus
scrapes it with the API key as a bearer token, and its query API must then show the
counters, histograms and gauges with bounded labels only (never a sandbox id)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.errors import DSecError
from tests.conftest import PlatformProcess, free_port, platform_process

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus"),
]


class Prometheus:
    """A Prometheus server scraping ``target`` every 0.5 s; stopped and removed after."""

    def __init__(self, target: str, api_key: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-prom-", dir="/tmp"))
        self.port = free_port()
        host = target.removeprefix("http://")
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 500ms, scrape_timeout: 400ms}\n"
            "scrape_configs:\n"
            "  - job_name: dsec\n"
            "    authorization: {type: Bearer, credentials: " + api_key + "}\n"
            f"    static_configs: [{{targets: ['{host}']}}]\n"
        )
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(self.dir / "log").open("wb"),
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(
            f"http://127.0.0.1:{self.port}/api/v1/query", params={"query": expr}, timeout=5
        )
        r.raise_for_status()
        result: list[dict[str, Any]] = r.json()["data"]["result"]
        return result

    def wait_for(self, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
        """The first non-empty answer to ``expr`` (Prometheus needs a scrape or two)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if rows := self.query(expr):
                    return rows
            if time.monotonic() > deadline:
                log = (self.dir / "log").read_text(errors="replace")[-2000:]
                raise AssertionError(f"Prometheus never answered {expr!r}; its log: {log}")
            time.sleep(0.25)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        yield p


@pytest.fixture
def prometheus(plat: PlatformProcess) -> Iterator[Prometheus]:
    server = Prometheus(plat.url, plat.api_key)
    try:
        yield server
    finally:
        server.close()


def test_prometheus_scrapes_the_platform(plat: PlatformProcess, prometheus: Prometheus) -> None:
    with DSecSyncClient(plat.url, plat.api_key) as client:
        client.build_image("busybox")
        sb = client.run_container(
            DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
        )
        for _ in range(3):
            assert sb.run_shell("true").exit_code == 0  # the data path
        with pytest.raises(DSecError):  # a typed failure: counted by its code
            client.run_container(
                DSecContainerRunArgs(container_image="no-such-image:1", memory_limit_mb=64)
            )
        up = prometheus.wait_for('up{job="dsec"} == 1')
        assert up, "Prometheus could not scrape /metrics"
        running = prometheus.wait_for('dsec_sandboxes{state="running",backend="container"}')
        assert float(running[0]["value"][1]) >= 1
        ok = prometheus.wait_for('dsec_sandbox_creates_total{outcome="ok"}')
        assert float(ok[0]["value"][1]) >= 1
        failed = prometheus.wait_for('dsec_sandbox_creates_total{outcome!="ok"}')
        assert {row["metric"]["outcome"] for row in failed} <= {"image_not_found", "not_found"}
        prometheus.wait_for("dsec_sandbox_create_seconds_count > 0")
        prometheus.wait_for('dsec_commands_total{outcome="exited"} >= 3')
        prometheus.wait_for("dsec_command_seconds_count >= 3")
        prometheus.wait_for("dsec_host_memory_available_bytes > 0")
        prometheus.wait_for("dsec_layer_cache_budget_bytes > 0")
        prometheus.wait_for("dsec_fncall_pools >= 0")
        sb.stop()
        prometheus.wait_for('dsec_sandbox_ends_total{state="stopped"} >= 1')
        # Labels stay bounded: no series names a sandbox.
        series = httpx.get(
            f"http://127.0.0.1:{prometheus.port}/api/v1/series",
            params={"match[]": '{job="dsec"}'},
            timeout=5,
        ).json()["data"]
        assert not [s for s in series if any(sb.id in v for v in s.values())]


def test_metrics_need_an_api_key(plat: PlatformProcess) -> None:
    assert httpx.get(f"{plat.url}/metrics", timeout=5).status_code == 401
    bad = httpx.get(f"{plat.url}/metrics", headers={"Authorization": "Bearer x"}, timeout=5)
    assert bad.status_code == 401
    good = httpx.get(
        f"{plat.url}/metrics", headers={"Authorization": f"Bearer {plat.api_key}"}, timeout=5
    )
    assert good.status_code == 200 and "dsec_sandboxes" in good.text
