"""dsec.edge.vmsnapshot's per-name reservation: snapshots to one name are serialised
(the free-name check and the registration never interleave), other names run at the
same time, and no entry outlives its holders."""

from __future__ import annotations

import asyncio

from dsec.edge import vmsnapshot


async def test_one_snapshot_per_name_at_a_time() -> None:
    locks = vmsnapshot.NameLocks()
    inside: dict[str, int] = {}
    most: dict[str, int] = {}

    async def one(name: str) -> None:
        async with locks.hold(name):
            inside[name] = inside.get(name, 0) + 1
            most[name] = max(most.get(name, 0), inside[name])
            await asyncio.sleep(0.01)
            inside[name] -= 1

    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(one(n) for n in ("a:1", "a:1", "a:1", "b:1", "c:1")))
    assert most == {"a:1": 1, "b:1": 1, "c:1": 1}
    assert asyncio.get_running_loop().time() - started < 0.2
    assert len(locks) == 0
