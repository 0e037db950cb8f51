"""One error envelope for every failure the HTTP API can produce.

Typed errors keep their code and status; FastAPI's own validation errors, routing
errors (404/405) and body-parsing errors are translated into the same envelope, and an
unexpected exception becomes a bare 500 ``internal`` whose traceback stays in the
server log. The SDK relies on this: it re-raises by ``code``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.errors import (
    DSecError,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
)
from dsec.exhaustion import typed_anywhere

log = logging.getLogger("dsec.apiserver")

JSON = "application/json"


class ErrorInfo(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorBody(BaseModel):
    """The body of every non-2xx response (documented in OpenAPI)."""

    error: ErrorInfo


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a request body passes its cap.

    It must be an HTTPException: FastAPI turns any other exception raised while it reads
    a JSON body into a generic 400, which would hide the typed ``limit_exceeded``.
    """

    def __init__(self, error: LimitExceeded) -> None:
        super().__init__(status_code=error.status, detail=error.message)
        self.error = error


def payload_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return Response(
        json.dumps(body, default=str).encode(),
        status_code=status,
        media_type=JSON,
        headers=headers,
    )


def error_response(exc: DSecError, headers: dict[str, str] | None = None) -> Response:
    if isinstance(exc, Unauthenticated):
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return payload_response(exc.status, exc.code, exc.message, exc.details, headers)


async def _on_dsec_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, DSecError)
    if exc.status in (500, 502):  # our own faults; 503/504 are expected under load
        log.warning("%s: %s", exc.code, exc.message)
    return error_response(exc)


def _loc_text(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc)


def validation_message(errors: Sequence[Any]) -> str:
    """``field: problem`` for each error, joined; readable enough to fix the request."""
    parts: list[str] = []
    for err in errors[:10]:
        loc = tuple(err.get("loc", ()))
        kind = err.get("type", "")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"body: malformed JSON ({ctx.get('error', 'decode error')})")
        elif loc == ("body",) and kind == "missing":
            parts.append("body: a JSON request body is required")
        elif loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
            parts.append(f"body: {msg} (send a JSON object with Content-Type: application/json)")
        else:
            parts.append(f"{_loc_text(loc) or 'request'}: {msg}")
    if len(errors) > 10:
        parts.append(f"... and {len(errors) - 10} more")
    return "; ".join(parts) or "invalid request"


async def _on_validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    details = {
        "errors": [
            {
                "loc": [str(p) for p in e.get("loc", ())],
                "msg": str(e.get("msg")),
                "type": str(e.get("type")),
            }
            for e in errors[:50]
        ]
    }
    err = InvalidArgument(validation_message(errors), **details)
    return error_response(err)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if isinstance(exc, BodyTooLarge):
        return error_response(exc.error)
    status = exc.status_code
    where = f"{request.method} {request.url.path}"
    if status == 404:
        return error_response(NotFound(f"no such route: {where}; see /docs for the API"))
    if status == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return payload_response(
            405,
            "method_not_allowed",
            f"method not allowed: {where}" + (f" (allowed: {allow})" if allow else ""),
            headers=dict(exc.headers or {}),
        )
    if status == 401:
        return error_response(Unauthenticated(str(exc.detail)))
    if status == 403:
        return error_response(PermissionDenied(str(exc.detail)))
    if status == 413:
        return error_response(PayloadTooLarge("request body is too large"))
    if status < 500:
        # 400 "There was an error parsing the body" and friends: bad input, not our fault.
        return error_response(InvalidArgument(f"invalid request: {exc.detail}"))
    log.error("HTTP %s for %s: %s", status, where, exc.detail)
    return payload_response(500, "internal", "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(DSecError, _on_dsec_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_exception)
    app.add_middleware(InternalErrorMiddleware)


class InternalErrorMiddleware:
    """Turn an unexpected exception into a 500 ``internal`` envelope, logged here once.

    Starlette's ServerErrorMiddleware would answer too but then re-raise, so the server
    would log every failure twice; this pure ASGI layer costs one closure per request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            # A full disk or no fds anywhere (e.g. the control database) is typed, not
            # a bug: 507/503 with what to do, and no traceback (dsec.exhaustion).
            typed = typed_anywhere(exc)
            if typed is not None and not started:
                await error_response(typed)(scope, receive, send)
                return
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = payload_response(
                500, "internal", "internal error; the server log has the details"
            )
            await response(scope, receive, send)
