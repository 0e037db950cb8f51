"""The SandboxFusion routes: ``POST /run_code`` over the FnCall service, and a typed
refusal for ``/run_jupyter``.

Auth: the same key store as every route. SandboxFusion's client sends no key of its
own, but ``requests`` turns a URL's userinfo into HTTP Basic auth, so the key rides in
``SANDBOX_FUSION_ENDPOINT=http://dsec:<key>@host:port`` (the password is the key, the
user name is ignored); ``Authorization: Bearer <key>`` works too. A missing or wrong
key is our typed 401 (the client raises with its message).

Errors: bad input (a language or field with no mapping) is our typed 4xx; a platform
error (5xx: exhausted, backend failure) is SandboxFusion's ``SandboxError`` with the
message, which its client raises, as its own server's sandbox errors are.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Security
from fastapi.security import (
    HTTPAuthorizationCredentials,
    HTTPBasic,
    HTTPBasicCredentials,
    HTTPBearer,
)
from starlette.responses import Response

from dsec.apiserver.auth import MISSING_KEY, KeyVerifier
from dsec.apiserver.fncall import FnCallBackend
from dsec.apiserver.responses import model_response
from dsec.compat.sandboxfusion.wire import (
    SFRunCodeRequest,
    SFRunCodeResponse,
    from_result,
    to_request,
)
from dsec.errors import DSecError, Unauthenticated, Unsupported
from dsec.fncall.languages import language

_basic = HTTPBasic(auto_error=False, description="any user name; the password is the API key")
_bearer = HTTPBearer(auto_error=False)


class BasicOrBearer:
    """The caller's principal from Basic (password = key) or Bearer credentials."""

    def __init__(self, keys: KeyVerifier) -> None:
        self._keys = keys

    async def __call__(
        self,
        basic: Annotated[HTTPBasicCredentials | None, Security(_basic)],
        bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> str:
        if bearer is not None:
            return await self._keys.verify(bearer.credentials)
        if basic is not None and basic.password:
            return await self._keys.verify(basic.password)
        raise Unauthenticated(
            MISSING_KEY + ", or put it in the endpoint URL: http://dsec:<key>@host:port"
        )


def sandboxfusion_router(service: FnCallBackend, keys: KeyVerifier) -> APIRouter:
    router = APIRouter(tags=["sandboxfusion"], dependencies=[Depends(BasicOrBearer(keys))])

    @router.post("/run_code", response_model=SFRunCodeResponse, summary="SandboxFusion run_code")
    async def run_code(body: SFRunCodeRequest) -> Response:
        """One run on the FnCall backend, answered in SandboxFusion's shape."""
        req = to_request(body)
        try:
            result = await service.run_code(req)
        except DSecError as exc:
            if exc.status < 500:
                raise
            failed = SFRunCodeResponse(status="SandboxError", message=f"{exc.code}: {exc.message}")
            return model_response(failed)
        compiled = language(req.args.language).compile is not None
        return model_response(from_result(result, compiled_language=compiled))

    @router.post("/run_jupyter", summary="SandboxFusion run_jupyter (not supported)")
    async def run_jupyter() -> Response:
        raise Unsupported(
            "run_jupyter is not supported: FnCall runs are stateless; use /run_code, or a "
            "session of a container sandbox for notebook-like state"
        )

    return router
