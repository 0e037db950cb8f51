"""The suite's free ports: dsec.net.ports.free_port with one slot per parallel worker.

pytest-xdist runs the suite in several processes; each picks from its own share of the
non-ephemeral ports, so two workers never hand out the same port, and no outgoing
connection takes one before its server binds it (dsec.net.ports says why that matters).
"""

from __future__ import annotations

import os

from dsec.net import ports


def worker_slot() -> tuple[int, int]:
    """(this worker's index, how many workers): (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % max(count, 1), max(count, 1)


def free_port() -> int:
    slot, slots = worker_slot()
    return ports.free_port(slot=slot, slots=slots)
