"""dsec.threads: what a worker thread acquires for a caller that was cancelled meanwhile
is given back, never left held for nobody; an undo runs to its end through the
caller's cancellations."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsec.threads import acquire_in_thread, undo_to_the_end


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


async def _failed_step_then_undo(undone: list[str], started: asyncio.Event) -> None:
    """A step that fails (here: is cancelled) and undoes what it made, as a create does."""
    try:
        await asyncio.sleep(10)  # the step: cancelled here
    except BaseException:

        async def undo() -> None:
            started.set()
            for part in ("cgroup", "layer", "directory"):
                await asyncio.sleep(0.05)  # each an await a cancellation could cut
                undone.append(part)

        await undo_to_the_end(undo())
        raise


async def test_an_undo_finishes_when_its_caller_is_cancelled_again() -> None:
    undone: list[str] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(_failed_step_then_undo(undone, started))
    await asyncio.sleep(0.01)
    task.cancel()  # the create's timeout
    await started.wait()
    task.cancel()  # then its client goes away
    await asyncio.sleep(0.01)
    task.cancel()  # and the platform shuts down
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == ["cgroup", "layer", "directory"]  # nothing left half undone


async def test_an_undo_inside_a_timeout_still_ends_as_the_timeout() -> None:
    """Cancelled once (by asyncio.timeout): the undo runs and the caller sees
    TimeoutError, as it would without the undo."""
    undone: list[str] = []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await _failed_step_then_undo(undone, asyncio.Event())
    assert undone == ["cgroup", "layer", "directory"]


async def test_an_undo_returns_its_result_and_raises_its_failure() -> None:
    async def tail() -> str:
        return "last console line"

    async def broken() -> None:
        raise OSError("busy")

    assert await undo_to_the_end(tail()) == "last console line"
    with pytest.raises(OSError, match="busy"):
        await undo_to_the_end(broken())
