"""Just enough of an RFB 3.8 client (a VNC viewer's protocol) to check what the edge's
live view relays: the handshake with the "None" security type, ServerInit's screen
size, and one full framebuffer update in Raw encoding. Used by tests/test_fullvm_vnc.py
and tests/test_fullvm_desktop.py."""

from __future__ import annotations

import struct

from websockets.sync.client import ClientConnection


class Rfb:
    """Just enough of an RFB 3.8 client to check what comes through the relay."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.buf = b""

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            msg = self.ws.recv(timeout=30)
            assert isinstance(msg, bytes), f"a text frame from the relay: {msg!r}"
            self.buf += msg
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def handshake(self) -> tuple[int, int, int]:
        """(width, height, bits per pixel) from ServerInit."""
        assert self.read(12) == b"RFB 003.008\n"
        self.ws.send(b"RFB 003.008\n")
        types = self.read(self.read(1)[0])
        assert 1 in types, f"QEMU's VNC asks for a password: {types!r}"
        self.ws.send(b"\x01")  # security type None
        assert self.read(4) == b"\0\0\0\0"  # SecurityResult: OK
        self.ws.send(b"\x01")  # ClientInit: shared
        width, height = struct.unpack(">HH", self.read(4))
        bpp = self.read(16)[0]
        self.read(struct.unpack(">I", self.read(4))[0])  # the desktop's name
        return width, height, bpp

    def full_update(self, width: int, height: int, bpp: int) -> int:
        """Ask for the whole screen in Raw encoding; the pixels covered by the update."""
        self.ws.send(struct.pack(">BBHi", 2, 0, 1, 0))  # SetEncodings: Raw
        self.ws.send(struct.pack(">BBHHHH", 3, 0, 0, 0, width, height))
        while True:
            kind = self.read(1)[0]
            if kind == 0:
                break
            assert kind == 2, f"unexpected server message {kind}"  # Bell: no payload
        _pad, count = struct.unpack(">BH", self.read(3))
        covered = 0
        for _ in range(count):
            x, y, w, h, enc = struct.unpack(">HHHHi", self.read(12))
            assert enc == 0 and x + w <= width and y + h <= height
            self.read(w * h * bpp // 8)
            covered += w * h
        return covered
