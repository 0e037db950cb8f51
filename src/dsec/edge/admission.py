"""Final admission authority of one host: refuse with a typed error when full.

The edge, not the caller, has the last word (DSEC.md, Edge): a refused caller retries
later or on another host. Admission is by *use*, not by the sum of limits (issue 19):
90% of RL sandboxes use at most 5% of the memory they ask for (paper §4), so a rule
that commits every limit in full turns a 24 GiB host away at ~400 sandboxes while its
memory sits idle. Four gates, cheapest first, each refusal naming its resource:

* **count** (``sandboxes``): derived from what the host's tables hold
  (dsec.resources.capacity: memory over the measured cost of an idle sandbox, pid_max
  and threads-max, file-max, the edge's own fd limit); ``DSEC_MAX_SANDBOXES`` overrides.
* **commitments** (``memory``, ``cpu``): limits summed against the host times an
  overcommit ratio, a backstop for the day every sandbox grows at once. Memory defaults
  to 32x (a sandbox at the RL p90 of 5% of its limit needs 20x; the use gates below
  catch the tail, and 32x lets 10,000 idle 64 MiB sandboxes in on 24 GiB). CPU is
  compressible (QoS classes share it, dsec.resources.qos), so by default it is not
  admitted by (``DSEC_CPU_OVERCOMMIT=0``); a ratio turns the gate on.
* **use** (``memory_available``): ``MemAvailable`` must keep a reserve for the host plus
  what one more sandbox costs the host with this many present (its memory cgroup's
  shrinker map grows with the count: dsec.resources.capacity).
* **pressure** (``memory_pressure``): the host's memory PSI ("some" avg10, percent) below
  ``DSEC_ADMISSION_PRESSURE``.

The last two are measured, so the edge first asks its idle reclaimer
(dsec.edge.idle) to make room (``shortfall`` says how much) and refuses only if the
host is still short afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dsec.api.spec import DSecRunArgs, RunArgs
from dsec.errors import AdmissionRejected, LimitExceeded
from dsec.resources.capacity import (
    Capacity,
    Pressure,
    SandboxCost,
    host_capacity,
    mem_available,
    memory_reserve_bytes,
    read_pressure,
)

MiB = 1 << 20
DEFAULT_MEMORY_OVERCOMMIT = 32.0
DEFAULT_CPU_OVERCOMMIT = 0.0  # not admitted by: CPU is compressible
DEFAULT_PRESSURE_LIMIT = 60.0  # PSI memory "some" avg10, percent


@dataclass(frozen=True)
class HostUse:
    """One reading of the measured gates: ``MemAvailable`` (bytes) and memory PSI (None
    where the kernel has none). A create takes one and both its shortfall and its
    admission decide on it (two reads of each file per create were ~0.1 ms of the
    create path); a reading taken before an await is stale after it."""

    available: int
    pressure: Pressure | None


def host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


class Admission:
    def __init__(
        self,
        *,
        max_sandboxes: int | None,
        memory_overcommit: float = DEFAULT_MEMORY_OVERCOMMIT,
        cpu_overcommit: float = DEFAULT_CPU_OVERCOMMIT,
        cost: SandboxCost | None = None,
        pressure_limit: float = DEFAULT_PRESSURE_LIMIT,
        measure_use: bool = True,
    ) -> None:
        self.host_cpus = os.cpu_count() or 1
        self.host_memory_mb = host_memory_mb()
        self.cost = cost or SandboxCost()
        self.reserve_bytes = memory_reserve_bytes(self.host_memory_mb * MiB)
        # The count limit: an explicit override, or what the host's tables allow.
        self.capacity: Capacity = (
            Capacity(max_sandboxes, "setting", {"setting": max_sandboxes})
            if max_sandboxes is not None
            else host_capacity(self.cost, memory_reserve_bytes=self.reserve_bytes)
        )
        self.max_sandboxes = self.capacity.max_sandboxes
        self.memory_overcommit = memory_overcommit
        self.memory_budget_mb = int(self.host_memory_mb * memory_overcommit)
        self.cpu_overcommit = cpu_overcommit
        self.cpu_budget = self.host_cpus * cpu_overcommit if cpu_overcommit > 0 else None
        self.pressure_limit = pressure_limit
        # Measured gates (MemAvailable, PSI); off only where a test wants the
        # arithmetic alone. Readers are attributes so a unit test can drive them.
        self.measure_use = measure_use
        self.read_available: Callable[[], int] = mem_available
        self.read_pressure: Callable[[], Pressure | None] = read_pressure
        # What a sandbox's memory commits: its limit by default (a container uses a
        # fraction of it, hence the overcommit); the edge sets it per backend.
        self.cost_mb: Callable[[RunArgs], int] = lambda spec: spec.memory_limit_mb
        self.count = 0
        self.memory_mb = 0
        self.cpu_cores = 0.0
        # Usage version, bumped on every change: orders the usage piggybacked on create
        # and stop answers against heartbeat reports (dsec.control.placement.EdgeLoad).
        # Starts at the clock (us) so that it keeps growing across a restart.
        self.seq = time.time_ns() // 1000
        # Told the reason of every refusal ("capacity", "memory", "cpu",
        # "memory_available", "memory_pressure", "helper_vm", "host_limit"): the edge
        # counts them in its metrics.
        self.on_refused: Callable[[str], None] = lambda reason: None

    def check_limits(self, spec: DSecRunArgs) -> None:
        """Limits no host of this size could ever honour: a 4xx, not a retry."""
        if spec.memory_limit_mb > self.host_memory_mb:
            self.on_refused("host_limit")
            raise LimitExceeded(
                f"memory_limit_mb={spec.memory_limit_mb} exceeds this host's "
                f"{self.host_memory_mb} MiB",
                host_memory_mb=self.host_memory_mb,
            )
        if spec.cpu_cores_limit > self.host_cpus:
            self.on_refused("host_limit")
            raise LimitExceeded(
                f"cpu_cores_limit={spec.cpu_cores_limit:g} exceeds this host's "
                f"{self.host_cpus} cores",
                host_cpus=self.host_cpus,
            )

    # -- measured use -------------------------------------------------------------------
    def measure(self) -> HostUse | None:
        """The host's use now, for shortfall() and admit(); None when use is not
        measured (the arithmetic gates only)."""
        if not self.measure_use:
            return None
        return HostUse(self.read_available(), self.read_pressure())

    def shortfall(self, use: HostUse | None = None) -> int:
        """Bytes of memory the host lacks to admit one more sandbox by use (0: none):
        what the edge's idle reclaimer is asked for before a refusal. Under memory
        pressure at least one sandbox's worth, whatever MemAvailable says. ``use``: a
        reading from measure() (else one is taken now)."""
        use = use or self.measure()
        if use is None:
            return 0
        need = self.reserve_bytes + self.cost.one_more(self.count) - use.available
        psi = use.pressure
        if psi is not None and psi.some_avg10 >= self.pressure_limit:
            need = max(need, 64 * MiB)
        return max(0, need)

    def _check_use(self, use: HostUse | None) -> None:
        use = use or self.measure()
        if use is None:
            return
        available = use.available
        # The host's measured figures stay out of the refusal: a tenant could watch
        # other tenants through them (the metrics have them, for the operator).
        if available < self.reserve_bytes + self.cost.one_more(self.count):
            self._refuse(
                "memory_available",
                f"host memory is in use: less than the {self.reserve_bytes // MiB} MiB kept "
                "for the host is available",
                reserve_mb=self.reserve_bytes // MiB,
            )
        psi = use.pressure
        if psi is not None and psi.some_avg10 >= self.pressure_limit:
            self._refuse(
                "memory_pressure",
                f"host memory is under pressure (PSI above {self.pressure_limit:g}%)",
                pressure_limit=self.pressure_limit,
            )

    def _refuse(self, resource: str, why: str, **details: Any) -> None:
        self.on_refused(resource)
        raise AdmissionRejected(
            f"{why}; retry later or on another host", resource=resource, **details
        )

    # -- admission ----------------------------------------------------------------------
    def admit(self, spec: RunArgs, use: HostUse | None = None) -> None:
        """Count ``spec`` in, or raise AdmissionRejected naming the resource. ``use``: a
        reading from measure() taken with no await since (else one is taken now)."""
        if self.count >= self.max_sandboxes:
            self.on_refused("capacity")
            raise AdmissionRejected(
                f"host is full: {self.count} of {self.max_sandboxes} sandboxes "
                f"(limited by {self.capacity.by}); retry later",
                resource="sandboxes",
                limited_by=self.capacity.by,
                running=self.count,
                capacity=self.max_sandboxes,
            )
        cost = self.cost_mb(spec)
        if self.memory_mb + cost > self.memory_budget_mb:
            self.on_refused("memory")
            raise AdmissionRejected(
                f"host memory is fully committed ({self.memory_mb} of "
                f"{self.memory_budget_mb} MiB); retry later",
                resource="memory",
                committed_mb=self.memory_mb,
                budget_mb=self.memory_budget_mb,
            )
        if self.cpu_budget is not None and self.cpu_cores + spec.cpu_cores_limit > self.cpu_budget:
            self._refuse(
                "cpu",
                f"host CPU is fully committed ({self.cpu_cores:g} of {self.cpu_budget:g} cores)",
                committed_cores=self.cpu_cores,
                budget_cores=self.cpu_budget,
            )
        self._check_use(use)
        self.count += 1
        self.memory_mb += cost
        self.cpu_cores += spec.cpu_cores_limit
        self.seq += 1

    @contextmanager
    def hold(self, memory_mb: int, what: str) -> Iterator[None]:
        """Admit a helper VM for the length of a step (a verifier or packer VM: it
        holds its memory like a sandbox, and takes a sandbox's slot); AdmissionRejected
        before anything starts when the host has no room, released at the end."""
        if self.count >= self.max_sandboxes or self.memory_mb + memory_mb > self.memory_budget_mb:
            self.on_refused("helper_vm")
            raise AdmissionRejected(
                f"no room for the {what} VM ({self.count} of {self.max_sandboxes} "
                f"sandboxes, {self.memory_mb} of {self.memory_budget_mb} MiB committed, "
                f"it needs {memory_mb} MiB); retry later",
                resource="memory" if self.count < self.max_sandboxes else "sandboxes",
                running=self.count,
                capacity=self.max_sandboxes,
                committed_mb=self.memory_mb,
                budget_mb=self.memory_budget_mb,
            )
        self.count += 1
        self.memory_mb += memory_mb
        self.seq += 1
        try:
            yield
        finally:
            self.count = max(0, self.count - 1)
            self.memory_mb = max(0, self.memory_mb - memory_mb)
            self.seq += 1

    def release(self, spec: RunArgs) -> None:
        self.count = max(0, self.count - 1)
        self.memory_mb = max(0, self.memory_mb - self.cost_mb(spec))
        self.cpu_cores = max(0.0, self.cpu_cores - spec.cpu_cores_limit)
        self.seq += 1

    def reset(self, live: Iterable[RunArgs]) -> None:
        self.count = 0
        self.memory_mb = 0
        self.cpu_cores = 0.0
        self.seq += 1
        for spec in live:
            self.count += 1
            self.memory_mb += self.cost_mb(spec)
            self.cpu_cores += spec.cpu_cores_limit

    def capacity_report(self) -> dict[str, float | int | str]:
        """What this host admits and why: fixed at start, so fit for the
        unauthenticated /v1/health (the host's measured use is not: a tenant could watch
        other tenants through it; ``report`` and the metrics have it)."""
        out: dict[str, float | int | str] = {
            "capacity": self.max_sandboxes,
            "capacity_limited_by": self.capacity.by,
            "memory_budget_mb": self.memory_budget_mb,
            "memory_overcommit": self.memory_overcommit,
            "cpu_overcommit": self.cpu_overcommit,
            "memory_reserve_mb": self.reserve_bytes // MiB,
            "pressure_limit": self.pressure_limit,
        }
        for name, n in self.capacity.limits.items():
            out[f"capacity_by_{name}"] = n
        return out

    def report(self) -> dict[str, float | int | str]:
        """``capacity_report`` with commitments and the host's measured use."""
        out = self.capacity_report()
        out["admitted"] = self.count
        out["memory_committed_mb"] = self.memory_mb
        out["cpu_committed_cores"] = round(self.cpu_cores, 3)
        out["memory_available_mb"] = self.read_available() // MiB
        psi = self.read_pressure()
        if psi is not None:
            out["memory_pressure_some_avg10"] = psi.some_avg10
            out["memory_pressure_full_avg10"] = psi.full_avg10
        return out
