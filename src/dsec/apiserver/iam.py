"""/v1/projects, /v1/principals, /v1/keys: IAM (dsec.control.iam).

Project paths contain ``/`` (``rl/math``), so a project's sub-resources sit after a
``/-/`` separator, as GitLab does for nested groups: ``/v1/projects/rl/math/-/quota``.
``-`` can never be a path segment (segments start with a letter or digit), so no
project path is ambiguous with a sub-resource.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from dsec.api.iam import (
    KeyCreate,
    KeyCreated,
    KeyInfo,
    PrincipalCreate,
    PrincipalInfo,
    ProjectCreate,
    ProjectInfo,
    QuotaInfo,
    QuotaLimits,
    RoleBinding,
    RoleGrant,
)
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.control.iam import IAM, ROOT, check_project
from dsec.control.keys import KeyStore


def _list(
    items: list[ProjectInfo] | list[PrincipalInfo] | list[KeyInfo] | list[RoleBinding],
) -> Response:
    body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
    return Response(body, media_type="application/json")


def _scope(path: str) -> str:
    """A project path, or ``*`` (ROOT: every project) where roles are concerned."""
    return path if path == ROOT else check_project(path)


def iam_router(iam: IAM, keys: KeyStore, auth: Authenticator) -> APIRouter:
    router = APIRouter(
        tags=["iam"], responses={"default": {"model": ErrorBody, "description": "typed error"}}
    )
    Principal = Annotated[str, Depends(auth)]

    # Sub-resource routes first: `{path:path}` would swallow `rl/-/quota` otherwise.
    @router.get(
        "/v1/projects/{path:path}/-/quota", response_model=QuotaInfo, summary="Quota and usage"
    )
    async def get_quota(path: str, caller: Principal) -> Response:
        return model_response(await iam.quota(caller, path))

    @router.put(
        "/v1/projects/{path:path}/-/quota",
        response_model=QuotaInfo,
        summary="Set a quota (admin on the parent)",
    )
    async def put_quota(path: str, body: QuotaLimits, caller: Principal) -> Response:
        """Replace the limits; null = no limit at this level. Never above the parent's;
        below current usage is accepted with a warning (running sandboxes go on)."""
        return model_response(await iam.set_quota(caller, path, body))

    @router.get(
        "/v1/projects/{path:path}/-/roles",
        response_model=list[RoleBinding],
        summary="Role bindings on a project (own and inherited); `*` is the root",
    )
    async def list_roles(path: str, caller: Principal) -> Response:
        return _list(await iam.bindings(caller, _scope(path)))

    @router.post(
        "/v1/projects/{path:path}/-/roles",
        response_model=RoleBinding,
        summary="Grant a role (admin there; never above your own)",
    )
    async def grant(path: str, body: RoleGrant, caller: Principal) -> Response:
        return model_response(await iam.grant(caller, body.principal, _scope(path), body.role))

    @router.delete(
        "/v1/projects/{path:path}/-/roles/{principal}", summary="Revoke a principal's binding"
    )
    async def revoke(path: str, principal: str, caller: Principal) -> dict[str, object]:
        revoked = await iam.revoke(caller, principal, _scope(path))
        return {"principal": principal, "project": path, "revoked": revoked}

    @router.post("/v1/projects", status_code=201, response_model=ProjectInfo, summary="Create")
    async def create_project(body: ProjectCreate, caller: Principal) -> Response:
        """A top-level project needs admin on the root; a sub-project admin on its parent."""
        return model_response(await iam.create_project(caller, body.path), 201)

    @router.get("/v1/projects", response_model=list[ProjectInfo], summary="List projects")
    async def list_projects(caller: Principal) -> Response:
        return _list(await iam.projects(caller))

    @router.get("/v1/projects/{path:path}", response_model=ProjectInfo, summary="Get a project")
    async def get_project(path: str, caller: Principal) -> Response:
        return model_response(await iam.get_project(caller, path))

    @router.delete("/v1/projects/{path:path}", status_code=204, summary="Delete an empty project")
    async def delete_project(path: str, caller: Principal) -> Response:
        await iam.delete_project(caller, path)
        return Response(status_code=204)

    @router.post("/v1/principals", status_code=201, response_model=PrincipalInfo, summary="Create")
    async def create_principal(body: PrincipalCreate, caller: Principal) -> Response:
        """Needs admin on some project; the new principal holds no role until granted."""
        return model_response(await iam.create_principal(caller, body), 201)

    @router.get("/v1/principals", response_model=list[PrincipalInfo], summary="List")
    async def list_principals(caller: Principal) -> Response:
        return _list(await iam.principals(caller))

    @router.post("/v1/keys", status_code=201, response_model=KeyCreated, summary="New API key")
    async def create_key(body: KeyCreate, caller: Principal) -> Response:
        """The plain key is in this answer only; the platform keeps its hash."""
        return model_response(await iam.create_key(caller, keys, body.principal), 201)

    @router.get("/v1/keys", response_model=list[KeyInfo], summary="List API keys")
    async def list_keys(
        caller: Principal, principal: Annotated[str | None, Query(max_length=128)] = None
    ) -> Response:
        return _list(await iam.list_keys(caller, principal))

    @router.delete("/v1/keys/{key_id}", response_model=KeyInfo, summary="Revoke an API key")
    async def revoke_key(key_id: str, caller: Principal) -> Response:
        return model_response(await iam.revoke_key(caller, keys, key_id))

    return router
