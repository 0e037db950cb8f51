"""The FnCall part of the HTTP protocol (requests and parsers, no I/O), like _protocol."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from dsec.api.fncall import (
    OP_CALL,
    OP_JUDGE,
    OP_RUN,
    CallRequest,
    CallResult,
    Comparator,
    DSecFnCallRunArgs,
    JudgeRequest,
    JudgeResult,
    JudgeTest,
    LanguageInfo,
    PoolInfo,
    RunCodeRequest,
    RunCodeResult,
    WarmPoolRequest,
)
from dsec.errors import DSecError
from dsec.sdk._protocol import Call, _list_of, _model, invalid, wait_timeout

_JSON_HEADERS = {"Content-Type": "application/json"}
# Slack over the call's own limits: waiting for a sandbox, the HTTP round trip.
_SLACK_S = 40.0
#: Larger requests go over HTTP: the server takes WebSocket messages up to 16 MiB, and
#: one character may take up to 12 bytes there (JSON escapes of astral characters).
WS_MAX_REQUEST_CHARS = 1 << 20

R = TypeVar("R", bound=BaseModel)

TestSpec = JudgeTest | tuple[str, str] | Mapping[str, str]


class RemoteCallFailed(DSecError):
    """``client.call`` ended without a value: killed by a limit, or crashed."""

    code = "call_failed"
    status = 500


def _post(
    path: str, body: BaseModel, parse: Callable[[httpx.Response], Any], timeout: float | None
) -> Call[Any]:
    return Call(
        "POST",
        path,
        parse,
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout),
    )


def _budget(args: DSecFnCallRunArgs) -> float:
    return args.timeout_s + args.compile_timeout_s + _SLACK_S


@dataclass(frozen=True, slots=True)
class FnCallOp(Generic[R]):
    """A run_code, judge or call: ``op`` on the FnCall WebSocket, or the same body POSTed
    to ``path`` (older servers, large requests)."""

    op: str
    path: str
    body: str
    result: type[R]
    timeout: float | None  # what the caller waits for the answer; None: no limit

    def http(self) -> Call[R]:
        return Call(
            "POST",
            self.path,
            _model(self.result),
            content=self.body.encode(),
            headers=_JSON_HEADERS,
            timeout=wait_timeout(self.timeout),
        )

    def ws_args(self) -> dict[str, Any] | None:
        """The args of the WebSocket message, or None if the request is too large for it."""
        if len(self.body) > WS_MAX_REQUEST_CHARS:
            return None
        args: dict[str, Any] = json.loads(self.body)
        return args

    def wait_s(self) -> float | None:
        """The WebSocket's wait, like the HTTP read timeout: past the server's own limits."""
        return None if self.timeout is None else self.timeout * 1.05 + 5.0

    def parse(self, result: Any) -> R:
        return self.result.model_validate(result)


def _op(op: str, path: str, body: BaseModel, result: type[R], timeout: float | None) -> FnCallOp[R]:
    return FnCallOp(op, path, body.model_dump_json(), result, timeout)


def run_code(
    args: DSecFnCallRunArgs,
    code: str,
    *,
    stdin: str = "",
    files: Mapping[str, str] | None = None,
    argv: Sequence[str] = (),
    timeout: float | None = None,
) -> FnCallOp[RunCodeResult]:
    try:
        body = RunCodeRequest(
            args=args, code=code, stdin=stdin, files=dict(files or {}), argv=list(argv)
        )
    except ValidationError as exc:
        raise invalid(exc) from None
    return _op(OP_RUN, "/v1/fncall/run", body, RunCodeResult, timeout or _budget(args))


def _test(t: TestSpec) -> JudgeTest:
    if isinstance(t, JudgeTest):
        return t
    if isinstance(t, tuple):
        return JudgeTest(stdin=t[0], expected=t[1])
    return JudgeTest.model_validate(dict(t))


def judge(
    args: DSecFnCallRunArgs,
    code: str,
    tests: Sequence[TestSpec],
    *,
    comparator: Comparator = "whitespace",
    float_tolerance: float = 1e-6,
    stop_on_failure: bool = False,
    files: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> FnCallOp[JudgeResult]:
    try:
        body = JudgeRequest(
            args=args,
            code=code,
            tests=[_test(t) for t in tests],
            comparator=comparator,
            float_tolerance=float_tolerance,
            stop_on_failure=stop_on_failure,
            files=dict(files or {}),
        )
    except (ValidationError, IndexError, TypeError) as exc:
        if isinstance(exc, ValidationError):
            raise invalid(exc) from None
        raise invalid_tests() from None
    # Tests run in parallel on the server; no read limit unless the caller sets one.
    return _op(OP_JUDGE, "/v1/fncall/judge", body, JudgeResult, timeout)


def invalid_tests() -> DSecError:
    from dsec.errors import InvalidArgument

    return InvalidArgument("tests must be (stdin, expected) pairs or {'stdin', 'expected'}")


def call(
    run_args: DSecFnCallRunArgs,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None = None,
) -> FnCallOp[CallResult]:
    import cloudpickle

    payload = base64.b64encode(cloudpickle.dumps((fn, args, kwargs))).decode()
    body = CallRequest(
        args=run_args, payload_b64=payload, python=f"{sys.version_info[0]}.{sys.version_info[1]}"
    )
    return _op(OP_CALL, "/v1/fncall/call", body, CallResult, timeout or _budget(run_args))


def call_value(res: CallResult) -> Any:
    """The function's return value, or its exception re-raised here (with the remote
    traceback as a note), or RemoteCallFailed when it was killed by a limit."""
    import cloudpickle

    if res.result_b64 is None:
        raise RemoteCallFailed(
            f"the call ended with status {res.status} (exit {res.exit_code}, "
            f"signal {res.signal}): {res.stderr[-2000:]}",
            status=res.status,
            call_id=res.call_id,
        )
    ok, value, tb = cloudpickle.loads(base64.b64decode(res.result_b64))
    if ok:
        return value
    if isinstance(value, BaseException):
        value.add_note(f"remote traceback (FnCall {res.call_id}):\n{tb}")
        raise value
    raise RemoteCallFailed(f"the call raised: {tb}", call_id=res.call_id)


def warm_pool(
    args: DSecFnCallRunArgs, size: int, *, wait: bool = True, timeout: float = 30.0
) -> Call[PoolInfo]:
    try:
        body = WarmPoolRequest(args=args, size=size, wait=wait, timeout_s=timeout)
    except ValidationError as exc:
        raise invalid(exc) from None
    return _post("/v1/fncall/pools/warm", body, _model(PoolInfo), timeout + _SLACK_S)


def list_pools() -> Call[list[PoolInfo]]:
    return Call("GET", "/v1/fncall/pools", _list_of(PoolInfo))


def languages() -> Call[list[LanguageInfo]]:
    return Call("GET", "/v1/fncall/languages", _list_of(LanguageInfo))
