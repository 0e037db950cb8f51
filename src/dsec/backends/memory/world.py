"""The in-memory backend's "kernel": the sandboxes that exist, process-wide.

Kept apart from the backend instance on purpose: a real sandbox outlives the edge
that made it, so an edge restarted in the same process (a new Edge, a new backend
instance, the same EdgeStateDB) must find its sandboxes still here to re-adopt them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class MemorySandbox:
    """One sandbox: its files, and the commands it ran (argv, for assertions)."""

    id: str
    boot: str  # changes when the sandbox is recreated: facts of an older one do not match
    files: dict[str, bytes] = field(default_factory=dict)
    ran: list[list[str]] = field(default_factory=list)


class MemoryWorld:
    """Every live in-memory sandbox of this process, by id."""

    def __init__(self) -> None:
        self._sandboxes: dict[str, MemorySandbox] = {}

    def start(self, sandbox_id: str, files: dict[str, bytes]) -> MemorySandbox:
        box = MemorySandbox(sandbox_id, secrets.token_hex(8), dict(files))
        self._sandboxes[sandbox_id] = box
        return box

    def get(self, sandbox_id: str) -> MemorySandbox | None:
        return self._sandboxes.get(sandbox_id)

    def kill(self, sandbox_id: str) -> bool:
        """Remove the sandbox; False when there was none (kill is idempotent)."""
        return self._sandboxes.pop(sandbox_id, None) is not None

    def ids(self) -> list[str]:
        return sorted(self._sandboxes)


#: The process-wide world every MemoryBackend instance shares.
WORLD = MemoryWorld()
