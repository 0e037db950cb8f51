"""FnCall methods of the SDK clients (``DSecClient`` / ``DSecSyncClient`` inherit them).

Stateless calls from warm pools, the same client as for containers::

    args = DSecFnCallRunArgs(image="debian-python:bookworm", language="python",
                             memory_limit_mb=256, timeout_s=5)
    r = await client.run_code(args, "print(input()[::-1])", stdin="abc")
    j = await client.judge(args.model_copy(update={"language": "cpp"}), src,
                           tests=[("1 2", "3"), ("2 2", "4")])
    value = await client.call(sum, [1, 2, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from dsec.fncall_model import (
    Comparator,
    DSecFnCallRunArgs,
    JudgeResult,
    LanguageInfo,
    PoolInfo,
    RunCodeResult,
)
from dsec.sdk import _fncall as proto
from dsec.sdk._fncall import RemoteCallFailed, TestSpec
from dsec.sdk._protocol import Call

T = TypeVar("T")

__all__ = ["FnCallMixin", "RemoteCallFailed", "SyncFnCallMixin"]


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class FnCallMixin:
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
        call = proto.run_code(args, code, stdin=stdin, files=files, argv=argv, timeout=timeout)
        return await self._send(call)

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
        call = proto.judge(
            args,
            code,
            tests,
            comparator=comparator,
            float_tolerance=float_tolerance,
            stop_on_failure=stop_on_failure,
            files=files,
            timeout=timeout,
        )
        return await self._send(call)

    async def call(
        self: _AsyncSender,
        fn: Callable[..., Any],
        *args: Any,
        run_args: DSecFnCallRunArgs | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)`` in a sandbox (cloudpickle; same Python version)."""
        res = await self._send(proto.call(run_args or DSecFnCallRunArgs(), fn, args, kwargs))
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
        call = proto.run_code(args, code, stdin=stdin, files=files, argv=argv, timeout=timeout)
        return self._send(call)

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
        call = proto.judge(
            args,
            code,
            tests,
            comparator=comparator,
            float_tolerance=float_tolerance,
            stop_on_failure=stop_on_failure,
            files=files,
            timeout=timeout,
        )
        return self._send(call)

    def call(
        self: _SyncSender,
        fn: Callable[..., Any],
        *args: Any,
        run_args: DSecFnCallRunArgs | None = None,
        **kwargs: Any,
    ) -> Any:
        res = self._send(proto.call(run_args or DSecFnCallRunArgs(), fn, args, kwargs))
        return proto.call_value(res)

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
