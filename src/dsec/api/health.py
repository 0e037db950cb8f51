"""Health on the wire: ok or degraded, and why."""

from __future__ import annotations

from typing import Literal

from dsec.api.base import Reply


class Degradation(Reply):
    """One reason the platform is degraded: an exhausted resource (``resource``) or a
    background component that died and is being restarted (``component``)."""

    resource: str | None = None
    component: str | None = None
    since: float  # unix time it started
    reason: str
    what_to_do: str | None = None
    restarts: int | None = None


class HealthInfo(Reply):
    """``degraded`` while a resource is exhausted or a component is down (``degraded``
    lists why and since when); ``ok`` again once it is back, without a restart."""

    status: Literal["ok", "degraded"] = "ok"
    version: str
    edge: str
    sandboxes_running: int
    capacity: int
    # What admission admits and why (dsec.edge.admission.Admission.capacity_report):
    # the capacity, the resource that limits it, the overcommit ratios and reserve.
    # Fixed at start; the host's measured use and pressure are in the metrics only.
    admission: dict[str, float | int | str] = {}
    degraded: list[Degradation] = []
    # The backends this edge runs (probed at start), and why each other one is not.
    backends: list[str] = []
    backends_unavailable: dict[str, str] = {}
    # Per running backend, what it runs on (e.g. microvm: accelerator kvm or tcg, and
    # why not kvm): the facts a benchmark or an operator must quote with its numbers.
    backend_details: dict[str, dict[str, str]] = {}
