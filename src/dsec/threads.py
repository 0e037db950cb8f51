"""Acquisitions and their undoing, safe against the caller's cancellation.

Why: ``await asyncio.to_thread(acquire)`` raises CancelledError in the caller as soon
as its task is cancelled, but the thread runs on and the acquisition happens anyway,
after the caller lost its only chance to record it: a reference nobody releases (a
layer mount that outlives the platform, a bound port). ``acquire_in_thread`` hands
whatever the thread acquired to ``release`` once the caller is gone.

The other half: a failed step undoes what it made (``Backend.create`` tears its half
made sandbox down), and a second cancellation (a create's timeout and then its
client's, or a shutdown) used to cut that undo at its first ``await``, leaving the
layer references, cgroups and directories it was releasing with nobody who knew of
them. ``undo_to_the_end`` finishes the undo first and raises the cancellation after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


async def acquire_in_thread(acquire: Callable[[], T], release: Callable[[T], object]) -> T:
    """``acquire()`` in a worker thread; its result is the caller's to release. If the
    caller is cancelled first, ``release`` gets the result as soon as the thread is done
    (on the event loop), and CancelledError goes on to the caller."""
    done = asyncio.ensure_future(asyncio.to_thread(acquire))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        done.add_done_callback(lambda fut: _give_back(fut, release))
        raise


def _give_back(fut: asyncio.Future[T], release: Callable[[T], object]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return  # nothing was acquired
    try:
        release(fut.result())
    except Exception:
        log.exception("giving back what a cancelled caller acquired failed")


async def undo_to_the_end(undo: Awaitable[T]) -> T:
    """Await ``undo`` to its end even if the caller is cancelled (again) meanwhile: a
    cancellation that arrives during it is raised once it is done, not lost. Its own
    failure is raised as usual (the caller decides whether it matters)."""
    task = asyncio.ensure_future(undo)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the undo itself was cancelled, not only us
                raise
            cancelled = True  # ours: wait on; the undo keeps running in its task
    if cancelled:
        raise asyncio.CancelledError
    return result
