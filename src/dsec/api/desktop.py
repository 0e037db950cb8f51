"""Computer use on the wire: one pointer or keyboard action (e2b-desktop's names).

A sandbox whose backend has a display (``Capability.COMPUTER_USE``: the fullvm
backend) takes these at ``POST {EDGE_PREFIX}/{id}/desktop/input`` and answers
screenshots at ``GET .../desktop/screenshot`` (PNG). Every other backend refuses both
with 501 ``unsupported`` before any work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dsec.api.base import Strict

ActionName = Literal[
    "mouse_move",
    "left_click",
    "right_click",
    "middle_click",
    "double_click",
    "scroll",
    "write",
    "press",
]
MAX_TEXT = 4096
MAX_CHORD = 8


class ComputerAction(Strict):
    """``mouse_move`` needs x and y; the clicks take them optionally (move first);
    ``scroll`` takes direction and amount; ``write`` text (US-keyboard ASCII);
    ``press`` keys: one key or a chord, e.g. ``["ctrl", "c"]``."""

    action: ActionName
    x: int | None = Field(None, ge=0, le=1 << 16)
    y: int | None = Field(None, ge=0, le=1 << 16)
    direction: Literal["up", "down"] = "down"
    amount: int = Field(1, ge=1, le=100)
    text: str | None = Field(None, max_length=MAX_TEXT)
    keys: list[str] | None = Field(None, min_length=1, max_length=MAX_CHORD)

    @model_validator(mode="after")
    def _fields(self) -> ComputerAction:
        if (self.x is None) != (self.y is None):
            raise ValueError("give both x and y, or neither")
        if self.action == "mouse_move" and self.x is None:
            raise ValueError("mouse_move needs x and y")
        if self.action == "write" and self.text is None:
            raise ValueError("write needs text")
        if self.action == "press" and not self.keys:
            raise ValueError("press needs keys")
        if self.keys is not None and any(not k or len(k) > 32 for k in self.keys):
            raise ValueError("a key name is 1 to 32 characters")
        return self
