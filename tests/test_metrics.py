"""/metrics, scraped by a real Prometheus server (Debian's `prometheus`, started here).

The platform runs sandboxes (a create, commands, a failed create, a stop; a job pause
and resume, a verify, a refused create, denied egress and refused DNS, a FnCall);
Prometheus scrapes it with the API key as a bearer token, and its query API must then
show the counters, histograms and gauges with bounded labels only (never a sandbox or
job id). ``DSEC_METRICS=0`` turns it all off."""

from __future__ import annotations

import contextlib
import os
import secrets
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
from dsec.api.exec import ExitInfo
from dsec.api.fncall import DSecFnCallRunArgs
from dsec.errors import DSecError, LimitExceeded, NotFound
from dsec.observe.metrics import Metrics, host_cpu
from tests.conftest import PlatformProcess, platform_process
from tests.ports import free_port

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


def value(rows: list[dict[str, Any]]) -> float:
    """The summed value of a query's rows."""
    return sum(float(row["value"][1]) for row in rows)


def test_pause_verify_refusals_network_and_pools_are_measured(
    plat: PlatformProcess, prometheus: Prometheus
) -> None:
    job = "metrics-" + secrets.token_hex(4)
    with DSecSyncClient(plat.url, plat.api_key) as client:
        client.build_image("busybox")
        sb = client.run_container(
            DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64, job_id=job)
        )
        try:
            client.pause_job(job)
            # per-job counts without a job label: one job live, one paused
            prometheus.wait_for('dsec_jobs{state="paused"} >= 1')
            assert value(prometheus.wait_for('dsec_jobs{state="live"}')) >= 1
            prometheus.wait_for("dsec_job_sandboxes_max >= 1")
            client.resume_job(job)
            prometheus.wait_for("dsec_pause_seconds_count >= 1")
            prometheus.wait_for("dsec_resume_seconds_count >= 1")
            assert value(prometheus.query("dsec_pause_seconds_sum")) > 0
            res = sb.verify("true", mode="isolated", timeout=60)
            assert res.passed
            prometheus.wait_for('dsec_verifies_total{outcome="passed"} >= 1')
            prometheus.wait_for("dsec_verify_seconds_count >= 1")
            # a create no host of this size could honour: refused, counted by reason
            with pytest.raises(LimitExceeded):
                client.run_container(
                    DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=1 << 20)
                )
            prometheus.wait_for('dsec_admission_refusals_total{reason="host_limit"} >= 1')
            assert value(prometheus.query('dsec_admission_refusals_total{reason="capacity"}')) == 0
        finally:
            sb.stop()
        # denied egress and a refused DNS name, from a sandbox with rules
        net = client.run_container(
            DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=64, network_rules={"pypi": False}
            )
        )
        try:
            # Nowhere: 198.19/16 holds no fake service (tests.fakenet uses 198.18/16);
            # 198.18.7.7 was once another worker's service's broadcast (host access).
            assert net.run_shell("nc -w 1 198.19.7.7 80 </dev/null", timeout=20).exit_code != 0
            assert net.run_shell("nslookup example.com", timeout=20).exit_code != 0
            prometheus.wait_for('dsec_egress_denials_total{target="egress"} >= 1')
            prometheus.wait_for('dsec_dns_refusals_total{reason="not_allowed"} >= 1')
        finally:
            net.stop()
        # a FnCall: the caller's wait for a warm sandbox is observed
        call = DSecFnCallRunArgs(image="busybox:latest", language="sh", memory_limit_mb=64)
        assert client.run_code(call, "echo hi").stdout == "hi\n"
        prometheus.wait_for("dsec_fncall_wait_seconds_count >= 1")
    # layers every create needed, already on this host; the host's CPU and load
    prometheus.wait_for("dsec_layer_cache_hits_total >= 1")
    assert value(prometheus.wait_for("dsec_layer_cache_misses_total")) == 0
    prometheus.wait_for('dsec_host_cpu_seconds_total{mode="idle"} > 0')
    prometheus.wait_for("dsec_host_cpus >= 1")
    prometheus.wait_for("dsec_host_load1 >= 0")
    # every label value is one the platform chose, never the job (or a sandbox) id
    series = httpx.get(
        f"http://127.0.0.1:{prometheus.port}/api/v1/series",
        params={"match[]": '{job="dsec"}'},
        timeout=5,
    ).json()["data"]
    assert not [s for s in series if any(job in v or sb.id in v for v in s.values())]


def test_metrics_switched_off() -> None:
    """DSEC_METRICS=0: /metrics is a typed 404, and the platform works as before."""
    with platform_process(DSEC_METRICS="0") as off:
        auth = {"Authorization": f"Bearer {off.api_key}"}
        r = httpx.get(f"{off.url}/metrics", headers=auth, timeout=5)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert "DSEC_METRICS=0" in r.json()["error"]["message"]
        with DSecSyncClient(off.url, off.api_key) as client:
            client.build_image("busybox")
            sb = client.run_container(
                DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)
            )
            assert sb.run_shell("true").exit_code == 0
            sb.stop()


def test_a_disabled_registry_records_nothing() -> None:
    """Every request-path update is a no-op when off (the switch is in one place)."""
    on, off = Metrics(), Metrics(enabled=False)
    exit = ExitInfo(exit_code=0, duration=0.01)
    for m in (on, off):
        m.created("container", 0.03)
        m.create_failed("container", "image_not_found")
        m.ended("container", "stopped")
        m.exec_done("container", 0.002)
        m.command_ended("container", exit)
        m.event("seccomp_violation")
        m.paused("container", 0.1)
        m.resumed("container", 0.001)
        m.verified("container", 1.0, "passed")
        m.admission_refused("capacity")
        m.egress_denied("metadata")
        m.dns_refused("query_rate")
        m.fncall_waited(0.005)
    text = on.render().decode()
    for line in (
        'dsec_sandbox_creates_total{backend="container",outcome="ok"} 1.0',
        'dsec_verifies_total{backend="container",outcome="passed"} 1.0',
        'dsec_admission_refusals_total{reason="capacity"} 1.0',
        'dsec_egress_denials_total{target="metadata"} 1.0',
        'dsec_dns_refusals_total{reason="query_rate"} 1.0',
        "dsec_fncall_wait_seconds_count 1.0",
        'dsec_pause_seconds_count{backend="container"} 1.0',
    ):
        assert line in text, line
    with pytest.raises(NotFound):
        off.render()
    off.enabled = True  # what it holds: nothing was recorded while off
    text = off.render().decode()
    assert "dsec_sandbox_creates_total{" not in text
    assert 'dsec_admission_refusals_total{reason="capacity"} 0.0' in text
    # a value outside a closed set is "other": no caller can grow a label set
    on.admission_refused("sandbox-1234")
    on.dns_refused("evil.example")
    text = on.render().decode()
    assert "sandbox-1234" not in text and "evil.example" not in text
    assert 'dsec_admission_refusals_total{reason="other"} 1.0' in text


def test_host_cpu_reads_proc(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  100 0 50 1000 5 0 1 0 0 0\ncpu0 1 2 3\n")
    (tmp_path / "loadavg").write_text("0.52 0.40 0.30 1/200 1234\n")
    got = {m.name: m for m in host_cpu(tmp_path)}
    cpu = {s.labels["mode"]: s.value for s in got["dsec_host_cpu_seconds"].samples}
    hz = os.sysconf("SC_CLK_TCK")
    assert cpu["user"] == 100 / hz and cpu["idle"] == 1000 / hz and len(cpu) == 8
    assert got["dsec_host_load1"].samples[0].value == 0.52
