"""The apiserver application: the single HTTP entry point of the platform.

It keeps no per-sandbox state; everything is asked of the edge and the image service,
so the same app routes to one in-process edge (`dsec up`) or to many (a cluster
apiserver). It is not a composition root: the roots (dsec.roots) build its services and
hand them over as one ApiServices value (dsec.apiserver.services). Only two light
pure-ASGI layers sit on the request path (body cap, last-resort error envelope) to keep
exec at ~2 ms.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI
from starlette.responses import PlainTextResponse, Response

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
from dsec.apiserver.limits import BodyLimitMiddleware
from dsec.apiserver.responses import model_response
from dsec.apiserver.rl import rl_router
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.sandboxes import sandbox_router
from dsec.apiserver.security import security_router
from dsec.apiserver.services import ApiServices
from dsec.apiserver.stats import stats_router
from dsec.apiserver.trajectory import trajectory_router
from dsec.apiserver.ui import ui_router
from dsec.apiserver.uisession import UISessions
from dsec.compat import e2b
from dsec.compat.sandboxfusion import sandboxfusion_router
from dsec.observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

API_VERSION = "0.1.0"


def create_app(services: ApiServices) -> FastAPI:
    """The HTTP app over ``services``: the routes of what is given, and nothing else.

    The composition roots (dsec.roots) build the services; this builds only HTTP
    plumbing (the auth dependency, routers, the batch runner, and a default creator
    when none is given), so the same services always get the same routes."""
    edge, keys, limits, iam = services.edge, services.keys, services.limits, services.iam
    dataplane = services.dataplane
    # The dashboard reads the sandbox list, stats and the audit log with its live
    # stream, served by one node (its AuditLog) and by a cluster apiserver (the edges'
    # logs, fanned in: dsec.cluster.fanout) alike; without /metrics its plots page says
    # so, and without job pause/resume its jobs page shows no buttons. Its sessions
    # live in this process (dsec.apiserver.uisession): behind a load balancer over
    # several apiservers a browser must stick to one of them.
    serve_ui = services.audit is not None
    jobs = services.rl is not None and services.roles is not None
    sessions = UISessions() if serve_ui else None
    auth = Authenticator(keys, sessions)
    # The one check of "may this caller use this sandbox" (dsec.apiserver.sandboxaccess).
    access = SandboxAccess(edge, iam, auth)
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
    app.state.sandbox_access = access  # a cluster apiserver's own routes use it too
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, default_limit=limits.max_json_bytes)

    @app.get("/v1/health", response_model=HealthInfo, tags=["platform"], summary="Health")
    async def health() -> Response:
        """Liveness and capacity; needs no API key."""
        return model_response(await edge.health())

    app.include_router(stats_router(edge, auth, access))

    if services.metrics is not None:
        metrics = services.metrics

        @app.get(
            "/metrics",
            tags=["platform"],
            summary="Prometheus metrics",
            dependencies=[Depends(auth)],
            response_class=PlainTextResponse,
        )
        async def prometheus_metrics() -> Response:
            """This process's metrics in Prometheus's text format (labels are bounded:
            backend, state, error code, event kind; never a sandbox id). Scrape with
            ``authorization: {type: Bearer, credentials: <API key>}``."""
            return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    data_path = dataplane.data_path if dataplane is not None else None
    # One create path for sandboxes and batches.
    creator = services.creator or SandboxCreator(edge, iam=iam)
    app.include_router(
        sandbox_router(
            edge,
            auth,
            limits,
            data_path=data_path,
            creator=creator,
            report_load=services.report_load,
            streams=services.streams or dataplane,
            access=access,
        )
    )
    app.state.batches = batch_runner(  # see cancel_batches_on_exit
        creator,
        data_path,
        parallelism=services.batches.parallelism,
        max_in_flight=services.batches.max_in_flight,
    )
    app.include_router(batch_router(app.state.batches, auth))
    if dataplane is not None:
        install_data_path(app, dataplane, keys, auth, limits, access)
    if services.images is not None:  # cluster mode: images live on the edges
        app.include_router(image_router(services.images, auth, limits))
    if services.layers is not None:
        app.include_router(layer_router(services.layers, auth))
    if services.audit is not None:
        app.include_router(security_router(services.audit, auth, access, creator.jobs))
    if services.fncall is not None:
        app.include_router(fncall_router(services.fncall, auth))
        app.include_router(sandboxfusion_router(services.fncall, keys))
    if services.trajectory is not None:
        app.include_router(trajectory_router(services.trajectory, auth, creator.jobs))
    if services.rl is not None and services.roles is not None:  # job pause, pack_diff, fork
        app.include_router(
            rl_router(
                services.rl, auth, services.roles, creator.jobs, access, charge=iam is not None
            )
        )
    if services.rollouts is not None:  # hosted rollouts (dsec.rollouts, dsec.cluster)
        from dsec.apiserver.rollouts import rollout_router

        app.include_router(rollout_router(services.rollouts, auth, creator.jobs))
    if iam is not None:  # projects, principals, keys, quotas, project roles
        app.include_router(iam_router(iam, keys, auth))
    if sessions is not None:
        app.include_router(ui_router(keys, sessions, job_control=jobs))
    e2b.install(app, services, creator)  # the E2B SDK's API (dsec.compat.e2b)
    return app
