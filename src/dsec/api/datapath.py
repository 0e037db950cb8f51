"""The data path's framing, shared by the SDK and the edge (no I/O, no server deps).

The data path is one WebSocket per client and edge (``/v1/edge/rpc``), multiplexing any
number of requests, because a command round trip must cost about what the agent costs:
an HTTP request through httpx alone costs ~0.7 ms of client CPU, a WebSocket message
~0.05 ms (measured on our machines).

- Text frames are JSON. A request is ``{"id", "op", "sandbox", "token"?, "args"}``; the
  answer is ``{"id", "result"}`` or ``{"id", "error": {"code", "message", "details"}}``.
  ``{"id": n, "op": "cancel"}`` abandons request ``n`` (a foreground command is killed).
- Binary frames carry output: ``u32 request id, u8 stream (1 stdout, 2 stderr), bytes``,
  always before the request's final answer.

The bodies of the ops are in dsec.api.exec and dsec.api.files.
"""

from __future__ import annotations

import struct
from typing import Literal

from pydantic import Field

from dsec.api.base import Strict

STDOUT = 1


STDERR = 2


_DATA = struct.Struct("<IB")


RPC_PATH = "/v1/edge/rpc"


EDGE_PREFIX = "/v1/edge/sandboxes"


def encode_data(request_id: int, stream: int, data: bytes) -> bytes:
    return _DATA.pack(request_id, stream) + data


def decode_data(frame: bytes) -> tuple[int, int, bytes]:
    if len(frame) < _DATA.size:
        raise ValueError("data frame shorter than its header")
    request_id, stream = _DATA.unpack_from(frame)
    return int(request_id), int(stream), frame[_DATA.size :]


class PtyControl(Strict):
    """Text frames of the PTY WebSocket, client to edge."""

    type: Literal["resize"]
    rows: int = Field(ge=1, le=0xFFFF)
    cols: int = Field(ge=1, le=0xFFFF)
