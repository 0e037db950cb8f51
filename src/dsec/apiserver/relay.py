"""Who passes a request on to a sandbox's own edge: the cluster apiserver's router.

Some route families are served by the edge that holds the sandbox and only passed
through by a cluster apiserver (the E2B drop-in's envd, dsec.compat.e2b.forward), so
that they have one implementation, the edge's. The apiserver keeps what is
cluster-wide (API keys, IAM, quotas, placement) and relays the rest; this is the
interface it relays through, implemented by dsec.cluster.router.ClusterEdge.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any, Protocol

import httpx


class EdgeRelay(Protocol):
    async def forward_to(
        self, sandbox_id: str, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        """An edge route, read whole; the edge's errors raised as our typed errors."""
        ...

    async def relay(
        self,
        sandbox_id: str,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        params: list[tuple[str, str]],
        content: AsyncIterable[bytes] | None,
    ) -> httpx.Response:
        """A caller's request, its body streamed up; the answer unread whatever its
        status (the caller closes it). Typed errors only when the edge is not there."""
        ...
