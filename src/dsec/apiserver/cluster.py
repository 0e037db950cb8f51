"""/v1/cluster (edge heartbeats, the edge list) and the data-path token in cluster mode.

Heartbeats authenticate with the cluster token that edges and apiservers share, not
with an API key: an edge is not a principal, and no API key can pose as an edge.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import Response

from dsec.api.cluster import EdgeReport, EdgeStatus, HeartbeatReply
from dsec.api.sandbox import DataPathInfo
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.cluster.registry import Registry
from dsec.cluster.router import ClusterEdge
from dsec.control.roles import ADMIN
from dsec.errors import NotFound, PermissionDenied, Unauthenticated

_bearer = HTTPBearer(auto_error=False, description="the cluster token (edges only)")


def cluster_router(
    router: ClusterEdge,
    registry: Registry,
    token: str,
    auth: Authenticator,
    access: SandboxAccess,
) -> APIRouter:
    api = APIRouter(
        tags=["cluster"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]
    # A token is minted only for a sandbox the caller may use (404 for another's).
    Sandbox = Annotated[str, Depends(access.runtime)]

    async def edge_auth(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> None:
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise Unauthenticated("heartbeats need the cluster token (dsec edge --cluster-token)")

    @api.post(
        "/v1/cluster/heartbeat",
        response_model=HeartbeatReply,
        dependencies=[Depends(edge_auth)],
        summary="An edge's heartbeat (edges only)",
    )
    async def heartbeat(report: EdgeReport) -> Response:
        reply = await registry.heartbeat(report)
        if report.edge_id not in router.known_edges():
            await router.refresh()  # a new edge is placed on from its first beat
        return model_response(reply)

    @api.get("/v1/cluster/edges", response_model=list[EdgeStatus], summary="List edges")
    async def edges(_p: Principal) -> list[EdgeStatus]:
        return await registry.edges()

    @api.delete("/v1/cluster/edges/{edge_id}", summary="Forget a down edge (admin)")
    async def forget(edge_id: str, principal: Principal) -> dict[str, object]:
        if principal != ADMIN:
            raise PermissionDenied("only the admin principal may forget edges")
        if not await registry.forget_edge(edge_id):
            raise NotFound(f"no down edge {edge_id!r} (only a down edge can be forgotten)")
        return {"edge_id": edge_id, "forgotten": True}

    @api.post(
        "/v1/sandboxes/{sandbox_id}/token",
        response_model=DataPathInfo,
        tags=["sandboxes"],
        summary="Get a data-path token (minted by the sandbox's edge)",
    )
    async def data_path(sandbox_id: Sandbox) -> Response:
        return model_response(await router.data_path(sandbox_id))

    @api.post(
        "/v1/sandboxes/{sandbox_id}/view-token",
        response_model=DataPathInfo,
        tags=["sandboxes"],
        summary="Get a live-view-only token (minted by the sandbox's edge)",
    )
    async def view_token(sandbox_id: Sandbox) -> Response:
        return model_response(await router.data_path(sandbox_id, scope="view"))

    return api
