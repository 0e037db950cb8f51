"""dsec.resources.lowprio: teardown's threads run niced, the caller's thread is not."""

from __future__ import annotations

import os
import threading

from dsec.resources.lowprio import NICE, LowPriorityPool


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_pool_threads_are_niced_and_the_pool_restarts_after_close() -> None:
    before = _own_nice()
    pool = LowPriorityPool("dsec-test-low", workers=1)
    try:
        assert await pool.run(_own_nice) == min(19, before + NICE)
        assert _own_nice() == before  # the event loop's thread keeps its priority
    finally:
        pool.close()
    try:  # a backend closed and started again (an edge restart in-process) tears down
        assert await pool.run(lambda: 41 + 1) == 42
    finally:
        pool.close()
