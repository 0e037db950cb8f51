"""/v1/fncall: stateless calls (run_code, judge, call) from the edge's warm pools.

The same calls are served on one WebSocket per client (``FNCALL_RPC_PATH``), which is
what the SDK uses when the server has it: a warm bash call is ~1-3 ms on the edge, and
an HTTP request through httpx and FastAPI cost ~3 ms more (measured, bench_fncall.py).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel
from starlette.responses import Response
from starlette.websockets import WebSocket

from dsec.api.fncall import (
    FNCALL_RPC_PATH,
    OP_CALL,
    OP_JUDGE,
    OP_RUN,
    CallRequest,
    CallResult,
    JudgeRequest,
    JudgeResult,
    LanguageInfo,
    PoolInfo,
    RunCodeRequest,
    RunCodeResult,
    WarmPoolRequest,
)
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.apiserver.wsmux import MuxConnection, refuse_handshake
from dsec.errors import DSecError, InvalidArgument
from dsec.fncall.service import FnCallService

log = logging.getLogger("dsec.apiserver.fncall")


def _list(items: list[PoolInfo] | list[LanguageInfo]) -> Response:
    body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
    return Response(body, media_type="application/json")


class FnCallBackend(Protocol):
    """What the routes call: the edge's FnCallService, or in cluster mode
    dsec.cluster.fncall.ClusterFnCall (each call forwarded to one edge)."""

    async def run_code(self, req: RunCodeRequest) -> RunCodeResult: ...
    async def judge(self, req: JudgeRequest) -> JudgeResult: ...
    async def call(self, req: CallRequest) -> CallResult: ...
    async def warm(self, req: WarmPoolRequest) -> PoolInfo: ...
    def pools_info(self) -> list[PoolInfo]: ...
    def languages(self) -> list[LanguageInfo]: ...


def fncall_router(service: FnCallService | FnCallBackend, auth: Authenticator) -> APIRouter:
    router = APIRouter(
        tags=["fncall"],
        dependencies=[Depends(auth)],
        responses={"default": {"model": ErrorBody, "description": "typed error"}},
    )

    @router.post("/v1/fncall/run", response_model=RunCodeResult, summary="Run code once")
    async def run_code(body: RunCodeRequest) -> Response:
        """In a fresh sandbox from the warm pool of (image, limits); status says how it
        ended (ok, runtime_error, timeout, memory_limit, compile_error, output_limit)."""
        return model_response(await service.run_code(body))

    @router.post("/v1/fncall/judge", response_model=JudgeResult, summary="Judge code on tests")
    async def judge(body: JudgeRequest) -> Response:
        return model_response(await service.judge(body))

    @router.post("/v1/fncall/call", response_model=CallResult, summary="Call a pickled function")
    async def call(body: CallRequest) -> Response:
        return model_response(await service.call(body))

    @router.post("/v1/fncall/pools/warm", response_model=PoolInfo, summary="Warm a pool")
    async def warm(body: WarmPoolRequest) -> Response:
        return model_response(await service.warm(body))

    @router.get("/v1/fncall/pools", response_model=list[PoolInfo], summary="Warm pools")
    async def pools() -> Response:
        return _list(service.pools_info())

    @router.get("/v1/fncall/languages", response_model=list[LanguageInfo], summary="Languages")
    async def languages() -> Response:
        return _list(service.languages())

    # The WebSocket checks the key itself, at the handshake: a refused key is the
    # typed error as the HTTP answer to the upgrade.
    outer = APIRouter()
    outer.include_router(router)

    @outer.websocket(FNCALL_RPC_PATH)
    async def rpc(ws: WebSocket) -> None:
        """run_code, judge and call (ops fncall.run, fncall.judge, fncall.call; args and
        result as on the HTTP routes), multiplexed in ``dsec.api.datapath``'s framing."""
        header = ws.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        creds = None
        if scheme.lower() == "bearer" and key.strip():
            creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=key.strip())
        try:
            await auth.bearer(creds)
        except DSecError as exc:
            # Before the upgrade: an unauthenticated client never gets a socket to
            # send frames into (the typed error is the HTTP answer).
            await refuse_handshake(ws, exc)
            return
        await ws.accept()
        await FnCallRpc(ws, service, auth, creds).serve()

    return outer


class FnCallRpc(MuxConnection):
    """One client's FnCall WebSocket."""

    kind = "FnCall"

    def __init__(
        self,
        ws: WebSocket,
        service: FnCallService | FnCallBackend,
        auth: Authenticator,
        creds: HTTPAuthorizationCredentials | None,
    ) -> None:
        super().__init__(ws)
        self.service = service
        self.auth = auth
        self.creds = creds

    async def answer(self, rid: int, op: str, msg: dict[str, Any]) -> BaseModel:
        await self.auth.bearer(self.creds)  # per call: a revoked key stops working here too
        args = msg.get("args")
        if not isinstance(args, dict):
            raise InvalidArgument("args must be a JSON object (the HTTP route's body)")
        if op == OP_RUN:
            return await self.service.run_code(RunCodeRequest.model_validate(args))
        if op == OP_JUDGE:
            return await self.service.judge(JudgeRequest.model_validate(args))
        if op == OP_CALL:
            return await self.service.call(CallRequest.model_validate(args))
        raise InvalidArgument(f"unknown op {op!r}; one of {[OP_RUN, OP_JUDGE, OP_CALL]}")
