"""Prometheus metrics of one platform process (an edge, `dsec up`, or an apiserver).

One ``CollectorRegistry`` per ``Metrics`` (never the client library's global one), so
several platforms in one process (tests, benchmarks) do not share counters. Counters
and histograms are updated where things happen (the edge's create, stop, exec and
verify, job pause/resume, the audit log's events; admission, the network manager and
the FnCall service through callbacks), always through a method of ``Metrics``, so that
``DSEC_METRICS=0`` turns them all off in one place. Gauges, and counters other parts
keep anyway, are read when scraped, by collectors over what the process already keeps
(records, admission, the layer cache, /proc), so they cost nothing on the request path.

Labels are bounded sets the platform chooses: a backend kind, a sandbox state, an
error code, an event kind, a reason from a closed list (anything else is "other").
Never a sandbox id, an image, a job, a user or anything else a client or a sandbox
can choose: an agent must not be able to grow the operator's time-series database (or
write into its labels). Jobs are counted, never labelled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.api.exec import ExitInfo
from dsec.api.fncall import PoolInfo
from dsec.errors import NotFound

__all__ = [
    "CONTENT_TYPE",
    "GaugeCollector",
    "Metric",
    "Metrics",
    "counter",
    "fncall_gauges",
    "gauge",
    "host_cpu",
    "host_gauges",
    "layer_cache_gauges",
    "metrics_enabled",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# create: ~30 ms for a container, seconds for a cold microVM; exec: ~1-2 ms
CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
EXEC_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
# a pause freezes and reclaims (ms to seconds); a verify starts a verifier (0.1-30 s);
# a FnCall caller waits for a warm sandbox (0 when one is ready, ~10-100 ms to build)
PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
VERIFY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
WAIT_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
PRESSURE = ("cpu", "memory", "io")
# /proc/stat's first columns, in order (bounded: the kernel's, not anyone's choice)
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

# The closed label sets of the counters fed by other packages: a value outside its
# set is counted as "other", so no caller can grow the label set by mistake.
ADMISSION_REASONS = (
    "capacity",
    "memory",
    "cpu",
    "memory_available",
    "memory_pressure",
    "helper_vm",
    "host_limit",
    "exhausted",
)
EGRESS_TARGETS = ("egress", "host", "metadata", "sandbox")
DNS_REASONS = (
    "not_allowed",
    "malformed",
    "unknown_source",
    "address_limit",
    "query_rate",
    "malformed_name",
    "long_label",
    "long_name",
    "deep_name",
    "unique_subdomains",
)
OTHER = "other"


def metrics_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """The operator switch: ``DSEC_METRICS=0`` turns metric recording off."""
    return env.get("DSEC_METRICS", "1") != "0"


def _bounded(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else OTHER


class Metrics:
    """The registry and the request-path instruments; see the module docstring.

    Every update on a request path goes through a method here, so that
    ``enabled=False`` (``DSEC_METRICS=0``, :meth:`from_env`) makes each a no-op in
    one place: the A/B bench measures what metrics cost against exactly that."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
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
        self.pause_seconds = Histogram(
            "dsec_pause_seconds",
            "Job pause of one sandbox: freeze and memory reclaim",
            ["backend"],
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        self.resume_seconds = Histogram(
            "dsec_resume_seconds",
            "Resume (thaw) of one paused sandbox",
            ["backend"],
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        self.verify_seconds = Histogram(
            "dsec_verify_seconds",
            "Verify steps, start to verdict (or error)",
            ["backend"],
            buckets=VERIFY_BUCKETS,
            registry=r,
        )
        self.verifies = Counter(
            "dsec_verifies",
            "Verify steps by backend and outcome (passed, failed, or the error code)",
            ["backend", "outcome"],
            registry=r,
        )
        self.admission_refusals = Counter(
            "dsec_admission_refusals",
            "Creates and helper VMs refused by admission, by reason",
            ["reason"],
            registry=r,
        )
        self.egress_denials = Counter(
            "dsec_egress_denials",
            "Connections a sandbox's egress rules denied, by what was aimed at",
            ["target"],
            registry=r,
        )
        self.dns_refusals = Counter(
            "dsec_dns_refusals",
            "DNS queries of sandboxes refused by the edge's responder, by reason",
            ["reason"],
            registry=r,
        )
        self.fncall_wait_seconds = Histogram(
            "dsec_fncall_wait_seconds",
            "Time FnCall callers waited for a warm sandbox (about 0 when one was ready)",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        # Closed sets start at 0: a rate() works from the first scrape, and a panel
        # shows "none" rather than "no data".
        for reason in (*ADMISSION_REASONS, OTHER):
            self.admission_refusals.labels(reason)
        for target in (*EGRESS_TARGETS, OTHER):
            self.egress_denials.labels(target)
        for reason in (*DNS_REASONS, OTHER):
            self.dns_refusals.labels(reason)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Metrics:
        """The platform's metrics, on unless ``DSEC_METRICS=0``."""
        return cls(enabled=metrics_enabled(env))

    # -- the request path: every update, each a no-op when disabled ----------------------

    def created(self, backend: str, seconds: float) -> None:
        if self.enabled:
            self.creates.labels(backend, "ok").inc()
            self.create_seconds.labels(backend).observe(seconds)

    def create_failed(self, backend: str, code: str) -> None:
        """``code``: a DSecError's stable code (a bounded set), or "internal"."""
        if self.enabled:
            self.creates.labels(backend, code).inc()

    def ended(self, backend: str, state: str) -> None:
        """A sandbox reached its final state (stopped, failed)."""
        if self.enabled:
            self.ends.labels(backend, state).inc()

    def exec_done(self, backend: str, seconds: float) -> None:
        """A control-route exec answered (its round trip through the edge)."""
        if self.enabled:
            self.exec_seconds.labels(backend).observe(seconds)

    def command_ended(self, backend: str, exit: ExitInfo | None) -> None:
        if not self.enabled:
            return
        if exit is None:
            self.commands.labels(backend, "failed").inc()
            return
        self.commands.labels(backend, "timed_out" if exit.timed_out else "exited").inc()
        self.command_seconds.labels(backend).observe(exit.duration)

    def event(self, kind: str) -> None:
        """A misbehaviour event was raised (``kind``: an EventKind value)."""
        if self.enabled:
            self.events.labels(kind).inc()

    def paused(self, backend: str, seconds: float) -> None:
        if self.enabled:
            self.pause_seconds.labels(backend).observe(seconds)

    def resumed(self, backend: str, seconds: float) -> None:
        if self.enabled:
            self.resume_seconds.labels(backend).observe(seconds)

    def verified(self, backend: str, seconds: float, outcome: str) -> None:
        """``outcome``: passed, failed, or a DSecError's code (bounded)."""
        if self.enabled:
            self.verify_seconds.labels(backend).observe(seconds)
            self.verifies.labels(backend, outcome).inc()

    def admission_refused(self, reason: str) -> None:
        """``reason``: one of ADMISSION_REASONS (anything else counts as "other")."""
        if self.enabled:
            self.admission_refusals.labels(_bounded(reason, ADMISSION_REASONS)).inc()

    def egress_denied(self, target: str) -> None:
        """``target``: one of EGRESS_TARGETS ("egress": not allowed by the rules)."""
        if self.enabled:
            self.egress_denials.labels(_bounded(target, EGRESS_TARGETS)).inc()

    def dns_refused(self, reason: str) -> None:
        """``reason``: one of DNS_REASONS (a tunnel guard's reason, or why not)."""
        if self.enabled:
            self.dns_refusals.labels(_bounded(reason, DNS_REASONS)).inc()

    def fncall_waited(self, seconds: float) -> None:
        if self.enabled:
            self.fncall_wait_seconds.observe(seconds)

    # -- the scrape -----------------------------------------------------------------------

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        """The text a scrape gets; NotFound (404) when metrics are off, so a scraper
        sees at once that this target serves none (rather than an empty page that
        looks like a platform with nothing happening)."""
        if not self.enabled:
            raise NotFound("metrics are off on this platform (DSEC_METRICS=0)")
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


def counter(name: str, doc: str, value: float) -> Metric:
    """A counter some other part keeps anyway (a plain cumulative number), read at
    scrape time; ``name`` without ``_total`` (the text format adds it)."""
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def host_cpu(proc: Path = Path("/proc")) -> Iterator[Metric]:
    """Host CPU: seconds spent per mode since boot (/proc/stat; rate() of the non-idle
    modes over ``dsec_host_cpus`` is the busy share), and the 1-minute load average."""
    hz = os.sysconf("SC_CLK_TCK")
    first = (proc / "stat").read_text().split("\n", 1)[0].split()
    if first and first[0] == "cpu":
        family = CounterMetricFamily(
            "dsec_host_cpu_seconds", "Host CPU time since boot, by mode", labels=["mode"]
        )
        for mode, ticks in zip(CPU_MODES, first[1:], strict=False):
            family.add_metric([mode], int(ticks) / hz)
        yield family
    yield gauge("dsec_host_cpus", "Online CPUs of the host", [], [([], os.cpu_count() or 1)])
    load1 = float((proc / "loadavg").read_text().split()[0])
    yield gauge("dsec_host_load1", "Host load average over 1 minute", [], [([], load1)])


def host_gauges(proc: Path = Path("/proc")) -> Iterator[Metric]:
    """Host memory available, CPU, and pressure stall information (PSI, avg10 of
    "some")."""
    yield from host_cpu(proc)
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
    docs = {
        "hits": "Layers a sandbox needed that were on this host already",
        "misses": "Layers a sandbox needed that had to be fetched (whole or their index)",
    }
    for key, doc in docs.items():  # counted by HostLayers.prepare
        if isinstance(report.get(key), int):
            yield counter(f"dsec_layer_cache_{key}", doc, report[key])
    lazy = report.get("lazy") or {}
    for key in (
        "read_bytes",
        "fetch_bytes",
        "fetch_requests",
        "fetch_errors",
        "verify_failures",
        "chunks_fetched",
        "chunks_verified_from_cache",
    ):
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
