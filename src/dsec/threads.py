"""Acquisitions handed to a worker thread, safe against the caller's cancellation.

Why: ``await asyncio.to_thread(acquire)`` raises CancelledError in the caller as soon
as its task is cancelled, but the thread runs on and the acquisition happens anyway,
after the caller lost its only chance to record it: a reference nobody releases (a
layer mount that outlives the platform, a bound port). ``acquire_in_thread`` hands
whatever the thread acquired to ``release`` once the caller is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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
