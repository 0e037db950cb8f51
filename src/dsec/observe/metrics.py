"""Prometheus metrics of one platform process (an edge, `dsec up`, or an apiserver).

One ``CollectorRegistry`` per ``Metrics`` (never the client library's global one), so
several platforms in one process (tests, benchmarks) do not share counters. Counters
and histograms are updated where things happen (the edge's create, stop and exec,
the audit log's events); gauges are read when scraped, by collectors over what the
process already keeps (records, admission, /proc), so a scrape costs nothing on the
request path.

Labels are bounded sets the platform chooses: a backend kind, a sandbox state, an
error code, an event kind. Never a sandbox id, an image, a job, a user or anything
else a client or a sandbox can choose: an agent must not be able to grow the
operator's time-series database (or write into its labels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.api.exec import ExitInfo
from dsec.api.fncall import PoolInfo

__all__ = [
    "CONTENT_TYPE",
    "GaugeCollector",
    "Metric",
    "Metrics",
    "fncall_gauges",
    "gauge",
    "host_gauges",
    "layer_cache_gauges",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# create: ~30 ms for a container, seconds for a cold microVM; exec: ~1-2 ms
CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
EXEC_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
PRESSURE = ("cpu", "memory", "io")


class Metrics:
    """The registry and the request-path instruments; see the module docstring."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.creates = Counter(
            "dsec_sandbox_creates",
            "Sandbox creates by backend and outcome (ok, or the error code)",
            ["backend", "outcome"],
            registry=r,
        )
        self.ends = Counter(
            "dsec_sandbox_ends",
            "Sandboxes ended, by backend and final state (stopped, failed)",
            ["backend", "state"],
            registry=r,
        )
        self.create_seconds = Histogram(
            "dsec_sandbox_create_seconds",
            "Create latency (successful creates)",
            ["backend"],
            buckets=CREATE_BUCKETS,
            registry=r,
        )
        self.exec_seconds = Histogram(
            "dsec_exec_seconds",
            "Command round trip through the edge",
            ["backend"],
            buckets=EXEC_BUCKETS,
            registry=r,
        )
        self.commands = Counter(
            "dsec_commands",
            "Commands of the data path ended, by backend and outcome (exited, timed_out, failed)",
            ["backend", "outcome"],
            registry=r,
        )
        self.command_seconds = Histogram(
            "dsec_command_seconds",
            "Run time of data-path commands, as the in-sandbox agent measured it",
            ["backend"],
            buckets=EXEC_BUCKETS,
            registry=r,
        )
        self.events = Counter(
            "dsec_misbehaviour_events",
            "Security and resource-limit events by kind",
            ["kind"],
            registry=r,
        )

    def created(self, backend: str, seconds: float) -> None:
        self.creates.labels(backend, "ok").inc()
        self.create_seconds.labels(backend).observe(seconds)

    def create_failed(self, backend: str, code: str) -> None:
        """``code``: a DSecError's stable code (a bounded set), or "internal"."""
        self.creates.labels(backend, code).inc()

    def command_ended(self, backend: str, exit: ExitInfo | None) -> None:
        if exit is None:
            self.commands.labels(backend, "failed").inc()
            return
        self.commands.labels(backend, "timed_out" if exit.timed_out else "exited").inc()
        self.command_seconds.labels(backend).observe(exit.duration)

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GaugeCollector(Collector):
    """Gauges computed at scrape time by ``fn`` (a function of nothing: it reads what
    the process keeps). A failing read drops that scrape's gauges, never the scrape."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        try:
            yield from list(self.fn())
        except Exception:  # a scrape must not fail on one gauge
            return

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time: nothing to check at registration


def gauge(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]
) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def host_gauges(proc: Path = Path("/proc")) -> Iterator[Metric]:
    """Host memory available and pressure stall information (PSI, avg10 of "some")."""
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            kib = float(line.split()[1])
            yield gauge("dsec_host_memory_available_bytes", "MemAvailable", [], [([], kib * 1024)])
            break
    rows: list[tuple[list[str], float]] = []
    for resource in PRESSURE:
        try:
            text = (proc / "pressure" / resource).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("some "):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                rows.append(([resource], float(fields.get("avg10", "0"))))
    yield gauge(
        "dsec_host_pressure_some_avg10",
        "Share of the last 10 s some task stalled on the resource (PSI, percent)",
        ["resource"],
        rows,
    )


def layer_cache_gauges(report: dict[str, Any]) -> Iterator[Metric]:
    """The host layer cache (LayerService.cache_report): budget, use, and the lazy
    loader's counters (cumulative, so Prometheus's rate() applies)."""
    yield gauge(
        "dsec_layer_cache_budget_bytes",
        "Layer cache budget",
        [],
        [([], report.get("budget_bytes") or 0)],
    )
    yield gauge(
        "dsec_layer_cache_used_bytes",
        "Layer cache in use",
        [],
        [([], report.get("used_bytes") or 0)],
    )
    lazy = report.get("lazy") or {}
    for key in ("read_bytes", "fetch_bytes", "fetch_requests", "fetch_errors", "verify_failures"):
        if isinstance(lazy.get(key), int | float):
            yield gauge(
                f"dsec_layer_lazy_{key}", f"Lazy loader {key} so far", [], [([], lazy[key])]
            )


def fncall_gauges(pools: Iterable[PoolInfo]) -> Iterator[Metric]:
    """FnCall warm pools, summed over pools (a pool's key names an image a client
    chose: never a label)."""
    rows = list(pools)
    yield gauge("dsec_fncall_pools", "FnCall warm pools", [], [([], len(rows))])
    for field in ("ready", "starting", "in_use", "target", "misses"):
        yield gauge(
            f"dsec_fncall_sandboxes_{field}" if field != "misses" else "dsec_fncall_misses",
            f"FnCall pools' {field}, summed",
            [],
            [([], sum(getattr(p, field) for p in rows))],
        )
