"""Computer use of a running sandbox: its screen and its input devices.

The edge's part is the same as for every other sandbox operation: the sandbox must be
running (a request also resets its idle TTL), its backend must declare
``Capability.COMPUTER_USE`` (else 501 naming backend and capability, before any
work), every action is audited, and a backend error that means the VM died fails the
sandbox (``Edge.call_running``). The backend does the rest (dsec.backends.fullvm).
"""

from __future__ import annotations

from dsec.api.desktop import ComputerAction
from dsec.api.events import AuditKind
from dsec.backends.base import Capability
from dsec.edge.edge import Edge


async def screenshot(edge: Edge, sandbox_id: str) -> bytes:
    """The sandbox's screen as PNG bytes."""
    rec = edge.running_record(sandbox_id)
    backend = edge.backend_of(rec, Capability.COMPUTER_USE)
    return await edge.call_running(sandbox_id, backend.screenshot)


async def computer_input(edge: Edge, sandbox_id: str, action: ComputerAction) -> None:
    """One pointer or keyboard action (the text typed is not audited, its length is)."""
    rec = edge.running_record(sandbox_id)
    backend = edge.backend_of(rec, Capability.COMPUTER_USE)
    edge.audit.record(
        sandbox_id,
        AuditKind.COMMAND,
        f"computer_{action.action}",
        x=action.x,
        y=action.y,
        keys=action.keys,
        text_chars=len(action.text) if action.text is not None else None,
    )
    await edge.call_running(sandbox_id, lambda r: backend.computer_input(r, action))
