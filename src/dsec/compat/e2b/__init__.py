"""E2B drop-in: the control-plane REST API and envd, for the unmodified `e2b` SDK.

Point the SDK at the platform with ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` both set to
its URL and ``E2B_API_KEY`` to one of our API keys. ``install`` mounts both route
families on an apiserver app; see README "E2B SDK" for what is and is not supported.

There is one implementation of envd: over a data plane (dsec.compat.e2b.envd), which
`dsec up` and every cluster edge have. A cluster apiserver has none; it serves the
control routes itself (keys, IAM, quotas, placement, Idempotency-Key: the same
SandboxCreator as our own routes, through the cluster router) and relays envd to the
sandbox's edge (dsec.compat.e2b.forward), streamed both ways. What the control routes
need of one sandbox (its envd token, its idle clock) is asked of its edge's own E2B
routes with the cluster token (dsec.compat.e2b.access).
"""

from __future__ import annotations

from fastapi import FastAPI

from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.services import ApiServices
from dsec.compat.e2b.access import Access
from dsec.compat.e2b.control import control_router
from dsec.compat.e2b.envd import Envd, envd_router
from dsec.compat.e2b.forward import EnvdRelay, envd_relay_router
from dsec.compat.e2b.mapping import E2BConfig


def install(app: FastAPI, services: ApiServices, creator: SandboxCreator) -> None:
    """Serve E2B on ``app``: envd over its data plane, else relayed to the edges
    (a cluster apiserver); nothing when it has neither."""
    plane, relay = services.dataplane, services.relay
    if plane is None and relay is None:
        return
    access = Access(
        services.keys,
        services.edge,
        plane,
        services.iam,
        services.rl,
        relay,
        sandboxes=app.state.sandbox_access,
    )
    app.include_router(control_router(access, creator, E2BConfig.from_env()))
    if plane is not None:
        app.include_router(envd_router(Envd(access, plane, services.limits)))
    elif relay is not None:
        app.include_router(envd_relay_router(EnvdRelay(access, relay, services.limits)))
