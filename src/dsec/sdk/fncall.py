"""FnCall methods of the SDK clients (``DSecClient`` / ``DSecSyncClient`` inherit them).

Stateless calls from warm pools, the same client as for containers::

    args = DSecFnCallRunArgs(image="debian-python:bookworm", language="python",
                             memory_limit_mb=256, timeout_s=5)
    r = await client.run_code(args, "print(input()[::-1])", stdin="abc")
    j = await client.judge(args.model_copy(update={"language": "cpp"}), src,
                           tests=[("1 2", "3"), ("2 2", "4")])
    value = await client.call(sum, [1, 2, 3])

run_code, judge and call go over one WebSocket per client (``FNCALL_RPC_PATH``, the API
key) when the server has it, else over HTTP: a warm call costs ~1-3 ms on the edge, and
an HTTP request through httpx and FastAPI ~3 ms more. The sync client sends them through
its async twin (``dsec.sdk._portal``), like its data path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from dsec.api.fncall import (
    FNCALL_RPC_PATH,
    CallResult,
    Comparator,
    DSecFnCallRunArgs,
    JudgeResult,
    LanguageInfo,
    PoolInfo,
    RunCodeResult,
)
from dsec.errors import PlatformUnavailable, Timeout
from dsec.sdk import _fncall as proto
from dsec.sdk._fncall import FnCallOp, RemoteCallFailed, TestSpec
from dsec.sdk._protocol import Call

if TYPE_CHECKING:
    from dsec.sdk._portal import Portal
    from dsec.sdk.client import DSecClient
    from dsec.sdk.datapath import DataPathClient

T = TypeVar("T")

__all__ = ["FnCallMixin", "RemoteCallFailed", "SyncFnCallMixin"]

# Why opening the WebSocket failed before anything was sent: the call then goes over
# HTTP, which fails (or not) exactly as it did before the WebSocket existed.
_NOT_OPENED = (OSError, InvalidHandshake, InvalidURI, TimeoutError)


class _AsyncSender(Protocol):
    _fncall_http_only: bool

    @property
    def _transport(self) -> object | None: ...

    async def _send(self, call: Call[T]) -> T: ...

    def _data_path(self) -> DataPathClient: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...

    def _portal(self) -> Portal: ...

    def _async_client(self) -> DSecClient: ...


async def _fncall(client: _AsyncSender, op: FnCallOp[Any]) -> Any:
    """``op`` over the client's FnCall WebSocket, or over HTTP where there is none."""
    # A custom HTTP transport (in-process apps, tests) is how the caller reaches the
    # server: FnCall follows it.
    http_only = client._fncall_http_only or client._transport is not None
    args = None if http_only else op.ws_args()
    if args is None:
        return await client._send(op.http())
    # Answers may be as large as over HTTP (outputs, pickled return values).
    rpc = client._data_path().api_rpc(FNCALL_RPC_PATH, max_size=None)
    try:
        result = await asyncio.wait_for(rpc.call(op.op, "", args), op.wait_s())
    except PlatformUnavailable as exc:
        if not isinstance(exc.__cause__, _NOT_OPENED):
            raise  # lost while the call was in flight: it may have run, so no retry
        if isinstance(exc.__cause__, InvalidStatus):
            client._fncall_http_only = True  # a server without the WebSocket route
        return await client._send(op.http())
    except TimeoutError:
        raise Timeout(f"no answer from {rpc.base_url} in time ({op.op})") from None
    return op.parse(result)


class FnCallMixin:
    #: Set once the server turned the FnCall WebSocket down (an older server).
    _fncall_http_only: bool = False

    async def run_code(
        self: _AsyncSender,
        args: DSecFnCallRunArgs,
        code: str,
        *,
        stdin: str = "",
        files: Mapping[str, str] | None = None,
        argv: Sequence[str] = (),
        timeout: float | None = None,
    ) -> RunCodeResult:
        """Run ``code`` once in a fresh sandbox; the result's ``status`` says how it ended."""
        op = proto.run_code(args, code, stdin=stdin, files=files, argv=argv, timeout=timeout)
        result: RunCodeResult = await _fncall(self, op)
        return result

    async def judge(
        self: _AsyncSender,
        args: DSecFnCallRunArgs,
        code: str,
        tests: Sequence[TestSpec],
        *,
        comparator: Comparator = "whitespace",
        float_tolerance: float = 1e-6,
        stop_on_failure: bool = False,
        files: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> JudgeResult:
        """Verdicts (AC, WA, TLE, MLE, RE, CE) of ``code`` on ``(stdin, expected)`` tests."""
        op = proto.judge(
            args,
            code,
            tests,
            comparator=comparator,
            float_tolerance=float_tolerance,
            stop_on_failure=stop_on_failure,
            files=files,
            timeout=timeout,
        )
        result: JudgeResult = await _fncall(self, op)
        return result

    async def call(
        self: _AsyncSender,
        fn: Callable[..., Any],
        *args: Any,
        run_args: DSecFnCallRunArgs | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)`` in a sandbox (cloudpickle; same Python version)."""
        op = proto.call(run_args or DSecFnCallRunArgs(), fn, args, kwargs)
        res: CallResult = await _fncall(self, op)
        return proto.call_value(res)

    async def warm_pool(
        self: _AsyncSender,
        args: DSecFnCallRunArgs,
        size: int,
        *,
        wait: bool = True,
        timeout: float = 30.0,
    ) -> PoolInfo:
        """Keep ``size`` sandboxes ready for ``args`` (and wait until they are)."""
        return await self._send(proto.warm_pool(args, size, wait=wait, timeout=timeout))

    async def fncall_pools(self: _AsyncSender) -> list[PoolInfo]:
        return await self._send(proto.list_pools())

    async def fncall_languages(self: _AsyncSender) -> list[LanguageInfo]:
        return await self._send(proto.languages())


class SyncFnCallMixin:
    """Blocking twins: run_code, judge and call run the async methods in the client's
    portal (one WebSocket for every thread), the rest is plain blocking HTTP."""

    def run_code(
        self: _SyncSender,
        args: DSecFnCallRunArgs,
        code: str,
        *,
        stdin: str = "",
        files: Mapping[str, str] | None = None,
        argv: Sequence[str] = (),
        timeout: float | None = None,
    ) -> RunCodeResult:
        return self._portal().call(
            self._async_client().run_code(
                args, code, stdin=stdin, files=files, argv=argv, timeout=timeout
            )
        )

    def judge(
        self: _SyncSender,
        args: DSecFnCallRunArgs,
        code: str,
        tests: Sequence[TestSpec],
        *,
        comparator: Comparator = "whitespace",
        float_tolerance: float = 1e-6,
        stop_on_failure: bool = False,
        files: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> JudgeResult:
        return self._portal().call(
            self._async_client().judge(
                args,
                code,
                tests,
                comparator=comparator,
                float_tolerance=float_tolerance,
                stop_on_failure=stop_on_failure,
                files=files,
                timeout=timeout,
            )
        )

    def call(
        self: _SyncSender,
        fn: Callable[..., Any],
        *args: Any,
        run_args: DSecFnCallRunArgs | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._portal().call(
            self._async_client().call(fn, *args, run_args=run_args, **kwargs)
        )

    def warm_pool(
        self: _SyncSender,
        args: DSecFnCallRunArgs,
        size: int,
        *,
        wait: bool = True,
        timeout: float = 30.0,
    ) -> PoolInfo:
        return self._send(proto.warm_pool(args, size, wait=wait, timeout=timeout))

    def fncall_pools(self: _SyncSender) -> list[PoolInfo]:
        return self._send(proto.list_pools())

    def fncall_languages(self: _SyncSender) -> list[LanguageInfo]:
        return self._send(proto.languages())
