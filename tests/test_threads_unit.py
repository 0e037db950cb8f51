"""dsec.threads: what a worker thread acquires for a caller that was cancelled meanwhile
is given back, never left held for nobody."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsec.threads import acquire_in_thread


async def test_a_cancelled_caller_gets_its_acquisition_released() -> None:
    go = threading.Event()
    released: list[str] = []

    def slow() -> str:
        go.wait(5)
        return "lease"

    task = asyncio.ensure_future(acquire_in_thread(slow, released.append))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == []  # the thread has not acquired anything yet
    go.set()
    for _ in range(100):
        if released:
            break
        await asyncio.sleep(0.01)
    assert released == ["lease"]


async def test_the_caller_that_waits_gets_the_result_and_nothing_is_released() -> None:
    released: list[int] = []
    assert await acquire_in_thread(lambda: 7, released.append) == 7
    await asyncio.sleep(0.01)
    assert released == []


async def test_a_failed_acquisition_is_raised_and_nothing_is_released() -> None:
    released: list[object] = []

    def broken() -> object:
        raise OSError("taken")

    with pytest.raises(OSError, match="taken"):
        await acquire_in_thread(broken, released.append)
    task = asyncio.ensure_future(acquire_in_thread(broken, released.append))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert released == []
