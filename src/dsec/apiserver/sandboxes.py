"""/v1/sandboxes: create, inspect, list, stop, exec, files.

Handlers stay thin: check parameters, call the edge, serialise. The edge raises typed
errors, which the app's handlers turn into the error envelope.
"""

# No `from __future__ import annotations`: FastAPI must see the local Principal type.

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from starlette.responses import Response

from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.sandbox import (
    IDEMPOTENCY_HEADER,
    CreateSandboxRequest,
    DataPathInfo,
    NetworkRules,
    SandboxInfo,
    SandboxState,
)
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.filestreams import FileStreams, read_response, write_body
from dsec.apiserver.limits import ApiLimits, set_body_limit
from dsec.apiserver.params import check_sandbox_path, parse_labels, parse_mode
from dsec.apiserver.responses import model_response, sandboxes_response
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.apiserver.trajectory import trajectory_ref
from dsec.control.placement import LOAD_HEADER, EdgeLoad
from dsec.edge.admission import Admission
from dsec.edge.api import EdgeAPI
from dsec.edge.idempotency import check_key

LIVE_STATES = frozenset(s for s in SandboxState if not s.terminal)

_OCTET = "application/octet-stream"


def sandbox_router(
    edge: EdgeAPI,
    auth: Authenticator,
    limits: ApiLimits,
    *,
    data_path: Callable[[str], Awaitable[DataPathInfo]] | None = None,
    creator: SandboxCreator | None = None,
    report_load: Admission | None = None,
    streams: FileStreams | None = None,
    access: SandboxAccess | None = None,
) -> APIRouter:
    creator = creator or SandboxCreator(edge)
    access = access or SandboxAccess(edge, creator.iam, auth)
    Principal = Annotated[str, Depends(auth)]
    # The path's sandbox, checked: the caller holds `runtime` on its project (else 404).
    Sandbox = Annotated[str, Depends(access.runtime)]

    async def with_data_path(info: SandboxInfo) -> SandboxInfo:
        """Create and inspect answers carry the edge URL and a token for the data path."""
        if data_path is not None and not info.state.terminal:
            info.data_path = await data_path(info.id)
        return info

    admission = report_load

    def with_load(resp: Response) -> Response:
        """An edge states its usage right after a create or stop (LOAD_HEADER): each
        apiserver then sees the others' placements on every edge it touches, not only
        at the next heartbeat (dsec.control.placement.EdgeLoad). Read in one go, so the
        figures and their sequence agree."""
        if admission is not None:
            a = admission
            resp.headers[LOAD_HEADER] = EdgeLoad(a.seq, a.count, a.memory_mb, a.cpu_cores).header()
        return resp

    router = APIRouter(
        prefix="/v1/sandboxes",
        tags=["sandboxes"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.post(
        "",
        status_code=201,
        response_model=SandboxInfo,
        summary="Create a sandbox",
        responses={200: {"model": SandboxInfo, "description": "replayed: the key's sandbox"}},
    )
    async def create_sandbox(
        body: CreateSandboxRequest,
        principal: Principal,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias=IDEMPOTENCY_HEADER,
                description="retry-safe create: the same key and spec return the same "
                "sandbox (200) for 24 h; another spec is a 409. 1-255 of A-Za-z0-9._:~+/=-",
            ),
        ] = None,
    ) -> Response:
        """Admit, prepare and start a sandbox; returns once it is running."""
        if idempotency_key is None:
            info = await creator.create(principal, body.spec, timeout=body.timeout)
            return with_load(model_response(await with_data_path(info), 201))
        info, made = await creator.create_keyed(
            principal, body.spec, timeout=body.timeout, key=check_key(idempotency_key)
        )
        resp = model_response(await with_data_path(info), 201 if made else 200)
        if not made:
            resp.headers["Idempotent-Replayed"] = "true"
        return with_load(resp)

    @router.get("", response_model=list[SandboxInfo], summary="List sandboxes")
    async def list_sandboxes(
        principal: Principal,
        label: Annotated[
            list[str], Query(description="`key=value` selector; repeat to AND several")
        ] = [],  # noqa: B006 - FastAPI copies query defaults
        state: Annotated[
            list[SandboxState],
            Query(
                description="repeatable; without it, only live sandboxes "
                "(creating, running, stopping) are listed"
            ),
        ] = [],  # noqa: B006
    ) -> Response:
        """Sandboxes matching every `label` selector AND any of the given `state`s.

        Without `state`, only live sandboxes (creating, running, stopping) are listed;
        repeat `state` with every value to see stopped and failed ones too.
        """
        states = set(state) if state else set(LIVE_STATES)
        items = await edge.list(labels=parse_labels(label) or None, states=states)
        return sandboxes_response(await access.visible(principal, items))

    @router.get("/{sandbox_id}", response_model=SandboxInfo, summary="Inspect a sandbox")
    async def get_sandbox(sandbox_id: Sandbox) -> Response:
        return model_response(await with_data_path(await edge.get(sandbox_id)))

    @router.delete("/{sandbox_id}", response_model=SandboxInfo, summary="Stop a sandbox")
    async def stop_sandbox(sandbox_id: Sandbox, principal: Principal) -> Response:
        """Terminate and release everything; idempotent. Returns the final state."""
        info = await creator.stop(principal, sandbox_id)
        return with_load(model_response(info))

    @router.post("/{sandbox_id}/exec", response_model=ExecResult, summary="Run a command")
    async def exec_command(
        sandbox_id: Sandbox, body: ExecRequest, principal: Principal
    ) -> Response:
        """Run one command to completion; a string goes through `/bin/sh -c`."""
        if body.trajectory is not None:  # a step of a job's log: the job's owner only
            await creator.jobs.claim(principal, body.trajectory.job_id, None, "logging a step")
        return model_response(await edge.exec(sandbox_id, body))

    @router.post("/{sandbox_id}/verify", response_model=VerifyResult, summary="Run a verifier step")
    async def verify_command(sandbox_id: Sandbox, body: VerifyRequest) -> Response:
        """Run a grader in a short-lived verifier built from the pristine image: it sees
        read-only snapshots of the graded paths and the protected paths (which the
        sandbox itself never does), never the agent's other changes. ``mode=fresh``
        (default) stops the sandbox first; ``isolated`` freezes it and lets it go on.
        The default user is root, the default timeout 600 s."""
        return model_response(await edge.verify(sandbox_id, body))

    @router.put(
        "/{sandbox_id}/network", response_model=NetworkRules, summary="Replace egress rules"
    )
    async def update_network(sandbox_id: Sandbox, body: NetworkRules) -> Response:
        """REPLACE (not merge) the egress rules of a running sandbox that was created
        with `network_rules`; new connections follow them at once, open ones go on."""
        rules = await edge.update_network(sandbox_id, body.network_rules)
        return model_response(rules)

    @router.get(
        "/{sandbox_id}/files",
        response_class=Response,
        responses={200: {"content": {_OCTET: {}}, "description": "the file's bytes"}},
        summary="Read a file",
    )
    async def read_file(
        sandbox_id: Sandbox, path: Annotated[str, Query(description="absolute path")]
    ) -> Response:
        if streams is not None:  # constant memory (dsec.apiserver.filestreams)
            return await read_response(streams, sandbox_id, check_sandbox_path(path))
        data = await edge.read_file(
            sandbox_id,
            check_sandbox_path(path),
            max_bytes=limits.max_file_bytes,
        )
        return Response(data, media_type=_OCTET)

    @router.put(
        "/{sandbox_id}/files",
        status_code=204,
        response_class=Response,
        summary="Write a file",
        openapi_extra={"requestBody": {"required": True, "content": {_OCTET: {"schema": {}}}}},
    )
    async def write_file(
        request: Request,
        sandbox_id: Sandbox,
        principal: Principal,
        path: Annotated[str, Query(description="absolute path")],
        mode: Annotated[str, Query(description="octal permissions")] = "644",
        job_id: Annotated[str | None, Query(description="trajectory: job")] = None,
        rollout_id: Annotated[str | None, Query(description="trajectory: rollout")] = None,
        step: Annotated[int | None, Query(description="trajectory: step number")] = None,
    ) -> Response:
        """Create or replace a file with the raw request body. With `job_id`,
        `rollout_id` and `step` it is a logged, replayable trajectory step."""
        sid = sandbox_id
        target = check_sandbox_path(path)
        perms = parse_mode(mode)
        traj = trajectory_ref(job_id, rollout_id, step)
        if traj is not None:  # a step of a job's log: the job's owner only
            await creator.jobs.claim(principal, traj.job_id, None, "logging a step")
        if traj is None and streams is not None:  # constant memory
            await write_body(streams, request, limits, sid, target, perms)
            return Response(status_code=204)
        # Buffered: a trajectory step is logged whole, so it has a cap of its own.
        cap = limits.max_file_bytes if traj is None else limits.max_step_file_bytes
        set_body_limit(request, cap, "file" if traj is None else "trajectory step file")
        chunks = [chunk async for chunk in request.stream()]
        if traj is None:
            await edge.write_file(sid, target, b"".join(chunks), mode=perms)
        else:
            await edge.write_file(sid, target, b"".join(chunks), mode=perms, trajectory=traj)
        return Response(status_code=204)

    return router
