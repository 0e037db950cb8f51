"""What edges and apiservers tell each other in cluster mode (heartbeats, edge status)."""

from __future__ import annotations

from pydantic import Field

from dsec.api.base import Reply, Strict

EDGE_ID_PATTERN = r"^[a-z0-9]{1,16}$"


class EdgeReport(Strict):
    """An edge's heartbeat: who it is, where it answers, what it has and holds.

    ``live`` (sandbox id -> age in seconds) is sent on the first beat after the edge
    starts, when the apiserver asks for it, and every ``full_every`` beats: the
    apiserver reconciles its directory against it. ``ended`` lists sandboxes that ended
    since the last acknowledged beat, with why, so their quota is released.
    """

    edge_id: str = Field(pattern=EDGE_ID_PATTERN)
    url: str = Field(max_length=256, pattern=r"^https?://[^\s/]+(:[0-9]+)?/?$")
    incarnation: str = Field(max_length=64, description="changes with every edge start")
    capacity: int = Field(ge=0)
    sandboxes: int = Field(ge=0)
    cpu_cores: float = Field(ge=0)
    cpu_committed: float = Field(ge=0)
    memory_mb: int = Field(ge=0)
    memory_committed_mb: int = Field(ge=0)
    backends: list[str] = Field(default_factory=list, max_length=16)
    labels: dict[str, str] = Field(default_factory=dict)
    images: list[str] = Field(default_factory=list, max_length=10_000)
    layers: list[str] = Field(default_factory=list, max_length=100_000)
    lazy: bool = Field(False, description="can load any layer on demand (shared store)")
    load_seq: int = Field(
        0, ge=0, description="usage version of these figures (orders them against answers)"
    )
    live: dict[str, float] | None = None
    ended: dict[str, str] = Field(default_factory=dict, description="id -> reason")


class HeartbeatReply(Reply):
    stop: list[str] = Field(
        default_factory=list, description="sandboxes the cluster no longer knows: stop them"
    )
    want_live: bool = Field(False, description="send the full live list next beat")
    interval: float = Field(0.5, description="seconds until the next beat")


class EdgeStatus(Reply):
    edge_id: str
    url: str
    status: str
    incarnation: str
    heartbeat_at: float
    down_since: float | None = None
    down_reason: str | None = None
    report: EdgeReport
