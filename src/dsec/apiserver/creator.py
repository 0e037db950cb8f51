"""The one path by which a sandbox comes to be and ends, for single creates and batches.

Every create goes through ``SandboxCreator`` so that authorisation, the project quota
charge, placement and the release of the charge when the sandbox ends are done in one
place, whether the edge is in-process (``dsec up``) or a cluster router
(dsec.cluster). Keeping it out of the HTTP handlers lets batch creation reuse it.
"""

from __future__ import annotations

from dsec.edge.api import EdgeAPI
from dsec.model import DSecContainerRunArgs, SandboxInfo


class SandboxCreator:
    def __init__(self, edge: EdgeAPI) -> None:
        self.edge = edge

    async def create(
        self, principal: str, spec: DSecContainerRunArgs, *, timeout: float
    ) -> SandboxInfo:
        """Create one sandbox on behalf of ``principal``; returns once it runs."""
        return await self.edge.create(spec, timeout=timeout)

    async def stop(self, principal: str, sandbox_id: str) -> SandboxInfo:
        """Stop a sandbox on behalf of ``principal``; idempotent."""
        return await self.edge.stop(sandbox_id)
