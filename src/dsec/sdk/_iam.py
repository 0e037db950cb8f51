"""The IAM part of the HTTP protocol (projects, principals, keys, roles, quotas):
requests and parsers, no I/O. Project sub-resources follow ``/-/`` (see
dsec.apiserver.iam)."""

from __future__ import annotations

from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from dsec.api.fields import PROJECT_RE
from dsec.api.iam import (
    ROOT,
    KeyCreate,
    KeyCreated,
    KeyInfo,
    PrincipalCreate,
    PrincipalInfo,
    ProjectCreate,
    ProjectInfo,
    QuotaInfo,
    QuotaLimits,
    Role,
    RoleBinding,
    RoleGrant,
)
from dsec.errors import InvalidArgument
from dsec.sdk._protocol import _JSON_HEADERS, Call, _list_of, _model, _nothing, invalid


def _project(path: str, *, root_ok: bool = False) -> str:
    if (root_ok and path == ROOT) or PROJECT_RE.match(path):
        return "/v1/projects/" + quote(path, safe="/*")
    raise InvalidArgument(
        f"invalid project path {path!r}: up to 8 segments of [a-z0-9._-] joined by '/'"
    )


def _body(model: type[BaseModel], **fields: object) -> bytes:
    try:
        return model(**fields).model_dump_json(exclude_none=False).encode()
    except ValidationError as exc:
        raise invalid(exc) from None


def create_project(path: str) -> Call[ProjectInfo]:
    return Call(
        "POST",
        "/v1/projects",
        _model(ProjectInfo),
        content=_body(ProjectCreate, path=path),
        headers=_JSON_HEADERS,
    )


def projects() -> Call[list[ProjectInfo]]:
    return Call("GET", "/v1/projects", _list_of(ProjectInfo))


def project(path: str) -> Call[ProjectInfo]:
    return Call("GET", _project(path), _model(ProjectInfo))


def delete_project(path: str) -> Call[None]:
    return Call("DELETE", _project(path), _nothing)


def quota(path: str) -> Call[QuotaInfo]:
    return Call("GET", _project(path) + "/-/quota", _model(QuotaInfo))


def set_quota(
    path: str, max_sandboxes: int | None, cpu_cores: float | None, memory_mb: int | None
) -> Call[QuotaInfo]:
    body = _body(QuotaLimits, max_sandboxes=max_sandboxes, cpu_cores=cpu_cores, memory_mb=memory_mb)
    return Call(
        "PUT", _project(path) + "/-/quota", _model(QuotaInfo), content=body, headers=_JSON_HEADERS
    )


def roles(path: str) -> Call[list[RoleBinding]]:
    return Call("GET", _project(path, root_ok=True) + "/-/roles", _list_of(RoleBinding))


def grant(path: str, principal: str, role: Role | str) -> Call[RoleBinding]:
    return Call(
        "POST",
        _project(path, root_ok=True) + "/-/roles",
        _model(RoleBinding),
        content=_body(RoleGrant, principal=principal, role=role),
        headers=_JSON_HEADERS,
    )


def revoke(path: str, principal: str) -> Call[None]:
    return Call(
        "DELETE",
        _project(path, root_ok=True) + "/-/roles/" + quote(principal, safe=""),
        _nothing,
    )


def create_principal(name: str, kind: str, default_project: str | None) -> Call[PrincipalInfo]:
    return Call(
        "POST",
        "/v1/principals",
        _model(PrincipalInfo),
        content=_body(PrincipalCreate, name=name, kind=kind, default_project=default_project),
        headers=_JSON_HEADERS,
    )


def principals() -> Call[list[PrincipalInfo]]:
    return Call("GET", "/v1/principals", _list_of(PrincipalInfo))


def create_key(principal: str) -> Call[KeyCreated]:
    return Call(
        "POST",
        "/v1/keys",
        _model(KeyCreated),
        content=_body(KeyCreate, principal=principal),
        headers=_JSON_HEADERS,
    )


def keys(principal: str | None) -> Call[list[KeyInfo]]:
    params = [("principal", principal)] if principal is not None else None
    return Call("GET", "/v1/keys", _list_of(KeyInfo), params=params)


def revoke_key(key_id: str) -> Call[KeyInfo]:
    return Call("DELETE", "/v1/keys/" + quote(key_id, safe=""), _model(KeyInfo))
