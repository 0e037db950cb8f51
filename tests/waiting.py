"""How a test waits for something to become true: one place, sync and async.

A test that polls names what it waits for, so a timeout reads as the failure it is
("not within 30s: the sandbox FAILED") instead of a bare ``assert False``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _timed_out(what: str, timeout: float, last: BaseException | None) -> AssertionError:
    tail = f" (last error: {last!r})" if last is not None else ""
    return AssertionError(f"not within {timeout}s: {what}{tail}")


def until(
    what: str,
    probe: Callable[[], T | None],
    timeout: float,
    *,
    interval: float = 0.05,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``probe`` until it returns something truthy, and return that.

    ``retry_on``: exceptions that mean "not yet" (a page mid-render), not a failure;
    the last one is named if time runs out."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = probe()
        except retry_on as exc:
            last = exc
        else:
            if got:
                return got
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)


async def until_async(
    what: str, probe: Callable[[], object], timeout: float, *, interval: float = 0.05
) -> None:
    """Await (or call) ``probe`` until it gives something truthy, without blocking
    the event loop between tries."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, None)
        await asyncio.sleep(interval)
