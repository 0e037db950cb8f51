"""The apiserver application: the single HTTP entry point of the platform.

It keeps no per-sandbox state; everything is asked of the edge and the image service,
so the same app can later route to many edges. Only two light pure-ASGI layers sit on
the request path (body cap, last-resort error envelope) to keep exec at ~2 ms.
"""

from __future__ import annotations

from typing import cast

from fastapi import FastAPI
from starlette.responses import Response

from dsec.api.health import HealthInfo
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.batch import batch_router, batch_runner
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.datapath import install_data_path
from dsec.apiserver.errors import ErrorBody, install_error_handlers
from dsec.apiserver.fncall import fncall_router
from dsec.apiserver.iam import iam_router
from dsec.apiserver.images import image_router
from dsec.apiserver.layers import layer_router
from dsec.apiserver.limits import ApiLimits, BodyLimitMiddleware
from dsec.apiserver.responses import model_response
from dsec.apiserver.rl import RLEdge, rl_router
from dsec.apiserver.sandboxes import sandbox_router
from dsec.apiserver.security import security_router
from dsec.apiserver.trajectory import trajectory_router
from dsec.backends.fncall.service import FnCallService
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.edge.api import EdgeAPI
from dsec.edge.dataplane import DataPlane
from dsec.images.layers import LayerService
from dsec.images.service import ImageService
from dsec.rl.trajectory import TrajectoryService
from dsec.security.audit import AuditLog

API_VERSION = "0.1.0"


def create_app(
    edge: EdgeAPI,
    images: ImageService | None,
    keys: KeyStore,
    *,
    limits: ApiLimits | None = None,
    dataplane: DataPlane | None = None,
    layers: LayerService | None = None,
    audit: AuditLog | None = None,
    fncall: FnCallService | None = None,
    roles: RoleStore | None = None,
    trajectory: TrajectoryService | None = None,
    creator: SandboxCreator | None = None,
    iam: IAM | None = None,
    report_load: bool = False,
) -> FastAPI:
    limits = limits or ApiLimits()
    auth = Authenticator(keys)
    app = FastAPI(
        title="DSec API",
        version=API_VERSION,
        description=(
            "Elastic, isolated, stateful sandboxes for agentic RL. Authenticate with "
            '`Authorization: Bearer <key>`. Every error is `{"error": {"code", '
            '"message", "details"}}` with the status of its code.'
        ),
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, default_limit=limits.max_json_bytes)

    @app.get("/v1/health", response_model=HealthInfo, tags=["platform"], summary="Health")
    async def health() -> Response:
        """Liveness and capacity; needs no API key."""
        return model_response(await edge.health())

    data_path = dataplane.data_path if dataplane is not None else None
    creator = creator or SandboxCreator(edge, iam=iam)  # one create path: sandboxes, batches
    app.include_router(
        sandbox_router(
            edge,
            auth,
            limits,
            data_path=data_path,
            creator=creator,
            report_load=report_load,
            streams=dataplane,
        )
    )
    app.state.batches = batch_runner(creator, data_path)  # see cancel_batches_on_exit
    app.include_router(batch_router(app.state.batches, auth))
    if dataplane is not None:
        install_data_path(app, dataplane, keys, auth, limits)
    if images is not None:  # cluster mode: images live on the edges
        app.include_router(image_router(images, auth, limits))
    if layers is not None:
        app.include_router(layer_router(layers, auth))
    if audit is not None:
        app.include_router(security_router(audit, auth))
    if fncall is not None:
        app.include_router(fncall_router(fncall, auth))
    if trajectory is not None:
        app.include_router(trajectory_router(trajectory, auth))
    if roles is not None and hasattr(edge, "pause_job"):  # job pause, pack_diff, fork
        app.include_router(rl_router(cast(RLEdge, edge), auth, roles, charge=iam is not None))
    if iam is not None:  # projects, principals, keys, quotas, project roles
        app.include_router(iam_router(iam, keys, auth))
    return app
