"""Parsing one request frame of the multiplexed WebSockets, with bounds.

Every frame is ``{"id": <int>, "op": <str>, ...}``. A frame that is merely wrong (not
JSON, no id) is a client bug and answered with a typed error on ``id`` 0; a frame no
client of ours sends (larger than the cap, nested deeper than the parser can follow)
is a ``FatalFrame``: the connection answers with a typed error and closes. Before
this, a deeply nested frame raised RecursionError out of the receive loop and an
``"id": Infinity`` an OverflowError: tracebacks, reachable without credentials.
"""

from __future__ import annotations

import json
from typing import Any

from dsec.errors import DSecError, InvalidArgument, PayloadTooLarge

# Larger than any request frame the SDK sends (file data goes over HTTP; FnCall's code,
# files and stdin are capped well below); uvicorn's own ws_max_size sits just above it.
MAX_FRAME_CHARS = 16 << 20
MAX_ID = (1 << 53) - 1  # exact in every JSON implementation
MAX_OP_CHARS = 64


class FatalFrame(Exception):
    """A frame that ends the connection; ``error`` is what the client is told."""

    def __init__(self, error: DSecError) -> None:
        super().__init__(error.message)
        self.error = error


def parse_request(text: str) -> tuple[int, str, dict[str, Any]]:
    """``(id, op, message)`` of one text frame."""
    if len(text) > MAX_FRAME_CHARS:
        raise FatalFrame(
            PayloadTooLarge(
                f"a request frame is limited to {MAX_FRAME_CHARS >> 20} MiB",
                limit_bytes=MAX_FRAME_CHARS,
            )
        )
    try:
        msg = json.loads(text)
    except RecursionError:  # the C scanner's own bound: far deeper than any request
        raise FatalFrame(InvalidArgument("request frame nested too deeply")) from None
    except ValueError:
        raise _malformed() from None
    if not isinstance(msg, dict):
        raise _malformed()
    rid, op = msg.get("id"), msg.get("op")
    if type(rid) is not int or not 0 <= rid <= MAX_ID:
        raise _malformed()
    if not isinstance(op, str) or not 0 < len(op) <= MAX_OP_CHARS:
        raise _malformed()
    return rid, op, msg


def _malformed() -> InvalidArgument:
    return InvalidArgument(
        f"every message needs a JSON object with an integer id (0..{MAX_ID}) and an op"
    )
