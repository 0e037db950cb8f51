"""Run the async data path from blocking code: one event loop in a helper thread.

The sync twins of sessions, streams, processes and files call the async implementation
through this portal, so both clients share one implementation of the data path and its
protocol (the control path of the sync client stays plain blocking httpx).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Portal:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="dsec-sync-portal", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the portal's loop and block until it is done."""
        future = asyncio.run_coroutine_threadsafe(coro, self._running_loop())
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C while waiting: abandon the call (kills a command)
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """A blocking iterator over an async one (closed with it)."""

        async def step() -> T:
            return await agen.__anext__()

        try:
            while True:
                try:
                    yield self.call(step())
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(agen, "aclose", None)
            if close is not None:
                self.call(_await(close()))

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


async def _await(value: Awaitable[T]) -> T:
    return await value
