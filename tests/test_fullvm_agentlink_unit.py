"""AgentLink's looks at the port of a full VM whose agent is not linked, without a VM:
a stand-in for QMP says whether the guest holds the port open, time is the test's."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.fullvm import agentlink
from dsec.backends.fullvm.agentlink import LOOK_EVERY, LOOK_MAX, AgentLink


class PortState:
    """Answers ``guest_opened`` as QMP would, and counts the questions."""

    def __init__(self) -> None:
        self.open = False
        self.asked = 0

    async def guest_opened(self, chardev: str, timeout: float = 5.0) -> bool:
        self.asked += 1
        return self.open


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    monkeypatch.setattr(agentlink, "PROBE_TIMEOUT", 0.2)  # a chardev nobody serves
    return Clock()


async def test_a_port_opened_late_is_looked_at_and_a_silent_one_less_and_less(
    tmp_path: Path, clock: Clock
) -> None:
    link = AgentLink(tmp_path / "q" / "agent.sock", tmp_path / "agent.sock", clock=clock)
    port = PortState()
    qmp = port  # only guest_opened is asked
    try:
        # Before the first probe ended (the boot's), the watcher never looks.
        assert not await link.look_again(qmp)  # type: ignore[arg-type]
        assert port.asked == 0
        # The boot's probe: nobody holds the port (an image without the agent).
        assert not await link.probe(qmp)  # type: ignore[arg-type]
        assert not await link.look_again(qmp)  # type: ignore[arg-type]  # too soon
        clock.now += LOOK_EVERY
        assert not await link.look_again(qmp)  # type: ignore[arg-type]  # still closed
        assert port.asked == 2
        # The guest opens it later: the next look says a probe is due.
        port.open = True
        clock.now += LOOK_EVERY
        assert await link.look_again(qmp)  # type: ignore[arg-type]
        # That probe gets no answer (nothing serves the chardev): the waits double.
        waits = []
        for _ in range(8):
            assert not await link.probe(qmp)  # type: ignore[arg-type]
            waited = 0.0
            while not await link.look_again(qmp):  # type: ignore[arg-type]
                clock.now += 1.0
                waited += 1.0
            waits.append(waited)
        assert waits[0] == 2 * LOOK_EVERY
        assert waits == sorted(waits) and waits[-1] == LOOK_MAX
        assert not link.ready
    finally:
        await link.close()
