"""/v1/fncall: stateless calls (run_code, judge, call) from the edge's warm pools."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.responses import Response

from dsec.apiserver.auth import Authenticator
from dsec.apiserver.errors import ErrorBody
from dsec.apiserver.responses import model_response
from dsec.backends.fncall.service import FnCallService
from dsec.fncall_model import (
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


def _list(items: list[PoolInfo] | list[LanguageInfo]) -> Response:
    body = "[" + ",".join(i.model_dump_json() for i in items) + "]"
    return Response(body, media_type="application/json")


def fncall_router(service: FnCallService, auth: Authenticator) -> APIRouter:
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

    return router
