"""E2B drop-in: the control-plane REST API and envd, for the unmodified `e2b` SDK.

Point the SDK at the platform with ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` both set to
its URL and ``E2B_API_KEY`` to one of our API keys. ``install`` mounts both route
families on an apiserver app that has a data plane (the routes use it for commands and
files); see README "E2B SDK" for what is and is not supported.
"""

from __future__ import annotations

from fastapi import FastAPI

from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.services import ApiServices
from dsec.compat.e2b.access import Access
from dsec.compat.e2b.control import control_router
from dsec.compat.e2b.envd import Envd, envd_router
from dsec.compat.e2b.mapping import E2BConfig


def install(app: FastAPI, services: ApiServices, creator: SandboxCreator) -> None:
    """Serve E2B on ``app`` when ``services`` has a data plane; else nothing."""
    plane = services.dataplane
    if plane is None:
        return
    access = Access(services.keys, services.edge, plane, services.iam, services.rl)
    app.include_router(control_router(access, creator, E2BConfig.from_env()))
    app.include_router(envd_router(Envd(access, services.limits)))
