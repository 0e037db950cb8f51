"""Composition root of `dsec edge --join`: a cluster edge.

A cluster edge is the single-node root (dsec.roots.platform) with three settings
changed and one companion added: its API key is the cluster token, it charges no
quota (the apiservers charged every create before it gets here), it states its load
in answers (placement reads it), and an EdgeNode (dsec.cluster.node) beats to the
apiservers beside the server. The host's services themselves (backend, Edge, images,
FnCall, data plane) are wired only in dsec.roots.platform, so that `dsec up` and a
cluster edge cannot drift apart; this root wires only the membership.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.cluster.node import EdgeNode
from dsec.config import PlatformConfig
from dsec.roots.platform import Platform, run


@dataclass
class EdgeJoin:
    join: list[str]
    cluster_token: str
    labels: dict[str, str] = field(default_factory=dict)
    interval: float = 0.5  # with the router's 0.25 s refresh: placement views <= 0.75 s old


def run_edge(
    config: PlatformConfig, join: EdgeJoin, *, ready: Callable[[str, str], None] | None = None
) -> None:
    """A `dsec up` that answers to the cluster token and beats to the apiservers."""
    config.api_key = join.cluster_token
    config.quotas = False  # the apiservers charge every create before it gets here
    config.report_load = True  # their placement reads it (dsec.control.placement)

    async def member(platform: Platform) -> None:
        node = EdgeNode(
            platform.edge,
            platform.images,
            join=join.join,
            token=join.cluster_token,
            url=config.url,
            labels=join.labels,
            lazy=bool(config.layer_store),
            interval=join.interval,
        )
        await node.run()

    run(config, ready=ready, companion=member)
