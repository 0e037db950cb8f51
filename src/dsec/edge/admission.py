"""Final admission authority of one host: refuse with a typed error when full.

The edge, not the caller, has the last word (DSEC.md, Edge): a refused caller retries
later or on another host. Memory is overcommitted on purpose (most sandboxes idle at a
fraction of their limit), but never beyond a configured factor of physical memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from dsec.api.spec import DSecRunArgs, RunArgs
from dsec.errors import AdmissionRejected, LimitExceeded


def host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


class Admission:
    def __init__(self, *, max_sandboxes: int, memory_overcommit: float) -> None:
        self.max_sandboxes = max_sandboxes
        self.host_cpus = os.cpu_count() or 1
        self.host_memory_mb = host_memory_mb()
        self.memory_overcommit = memory_overcommit
        self.memory_budget_mb = int(self.host_memory_mb * memory_overcommit)
        # What a sandbox's memory commits: its limit by default (a container uses a
        # fraction of it, hence the overcommit); the edge sets it per backend.
        self.cost_mb: Callable[[RunArgs], int] = lambda spec: spec.memory_limit_mb
        self.count = 0
        self.memory_mb = 0
        # CPU committed (limits of the sandboxes admitted): reported, not admitted by.
        self.cpu_cores = 0.0
        # Usage version, bumped on every change: orders the usage piggybacked on create
        # and stop answers against heartbeat reports (dsec.control.placement.EdgeLoad).
        # Starts at the clock (us) so that it keeps growing across a restart.
        self.seq = time.time_ns() // 1000
        # Told the reason of every refusal ("capacity", "memory", "helper_vm",
        # "host_limit"): the edge counts them in its metrics.
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

    def admit(self, spec: RunArgs) -> None:
        if self.count >= self.max_sandboxes:
            self.on_refused("capacity")
            raise AdmissionRejected(
                f"host is full: {self.count} of {self.max_sandboxes} sandboxes; retry later",
                running=self.count,
                capacity=self.max_sandboxes,
            )
        cost = self.cost_mb(spec)
        if self.memory_mb + cost > self.memory_budget_mb:
            self.on_refused("memory")
            raise AdmissionRejected(
                f"host memory is fully committed ({self.memory_mb} of "
                f"{self.memory_budget_mb} MiB); retry later",
                committed_mb=self.memory_mb,
                budget_mb=self.memory_budget_mb,
            )
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
