"""/v1/stats: resource use of live sandboxes, each caller's own.

With IAM, a caller without a role on every project sees only the sandboxes of the
projects it holds a role on (dsec.apiserver.sandboxaccess); asking for another
tenant's sandbox by id answers as for one that is not live: an empty list.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from dsec.api.sandbox import SandboxStats
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.sandboxes import LIVE_STATES
from dsec.edge.api import EdgeAPI
from dsec.errors import SandboxNotFound

_EMPTY = "[]"


def stats_router(edge: EdgeAPI, auth: Authenticator, access: SandboxAccess) -> APIRouter:
    router = APIRouter(tags=["platform"])
    Principal = Annotated[str, Depends(auth)]

    @router.get(
        "/v1/stats", response_model=list[SandboxStats], summary="Resource use of live sandboxes"
    )
    async def sandbox_stats(
        principal: Principal,
        sandbox_id: Annotated[
            str | None,
            Query(max_length=64, description="only this sandbox (empty list if not live)"),
        ] = None,
    ) -> Response:
        """Memory, CPU time, disk and idle time of every live sandbox the caller may
        use, read now (a cluster apiserver asks every edge that answers). CPU use is the
        change of ``cpu_seconds`` between two calls."""
        if sandbox_id is not None:
            try:
                await access.require(principal, sandbox_id)
            except SandboxNotFound:
                return Response(_EMPTY, media_type="application/json")
        items = await edge.stats(sandbox_id)
        if sandbox_id is None and not await access.sees_all(principal):
            live = await edge.list(states=set(LIVE_STATES))
            mine = {i.id for i in await access.visible(principal, live)}
            items = [i for i in items if i.id in mine]
        body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
        return Response(body, media_type="application/json")

    return router
