"""Computer use of a full VM through QMP: screenshots and input, no guest software.

Why QMP: ``screendump`` reads the display adapter's framebuffer (QEMU 7.2 writes PNG
with ``format=png``) and ``input-send-event`` injects keyboard, pointer and wheel
events as the virtual hardware's own, so it works for any OS, before login, and for a
guest with no agent at all. The jailed QEMU can only write inside its own socket
directory, so a screenshot is written there, read back bounded, and removed.

Pointer positions are absolute (a virtio-tablet): QMP takes them scaled to
0..0x7fff of the current screen, which is read from the last screenshot's size
(one is taken first if there is none yet).

Names follow e2b-desktop: ``mouse_move``, ``left_click``, ``right_click``,
``double_click``, ``scroll``, ``write`` (type text), ``press`` (a key or a chord).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsec.backends.microvm.qmp import Qmp
from dsec.errors import BackendError, InvalidArgument

ABS_MAX = 0x7FFF
MAX_PNG = 64 << 20  # a 8K RGB screen compresses far below this
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEY_GAP = 0.01  # seconds between typed characters: the PS/2 queue is short

# Key names (e2b-desktop / xdotool style, lower case) -> QEMU qcodes.
NAMED_KEYS: dict[str, str] = {
    "enter": "ret", "return": "ret", "space": "spc", "tab": "tab", "backspace": "backspace",
    "escape": "esc", "esc": "esc", "delete": "delete", "insert": "insert",
    "home": "home", "end": "end", "pageup": "pgup", "page_up": "pgup",
    "pagedown": "pgdn", "page_down": "pgdn", "up": "up", "down": "down",
    "left": "left", "right": "right", "ctrl": "ctrl", "control": "ctrl",
    "shift": "shift", "alt": "alt", "meta": "meta_l", "super": "meta_l", "win": "meta_l",
    "capslock": "caps_lock", "menu": "menu",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
}  # fmt: skip
# US layout: character -> (qcode, shifted)
_PLAIN = {
    " ": "spc", "\n": "ret", "\t": "tab", "-": "minus", "=": "equal", "[": "bracket_left",
    "]": "bracket_right", "\\": "backslash", ";": "semicolon", "'": "apostrophe",
    "`": "grave_accent", ",": "comma", ".": "dot", "/": "slash",
}  # fmt: skip
_SHIFTED = {
    "!": "1", "@": "2", "#": "3", "$": "4", "%": "5", "^": "6", "&": "7", "*": "8",
    "(": "9", ")": "0", "_": "minus", "+": "equal", "{": "bracket_left",
    "}": "bracket_right", "|": "backslash", ":": "semicolon", '"': "apostrophe",
    "~": "grave_accent", "<": "comma", ">": "dot", "?": "slash",
}  # fmt: skip
BUTTONS = ("left", "right", "middle")


def char_key(ch: str) -> tuple[str, bool]:
    """(qcode, needs shift) of one character on a US keyboard; InvalidArgument else."""
    if "a" <= ch <= "z" or "0" <= ch <= "9":
        return ch, False
    if "A" <= ch <= "Z":
        return ch.lower(), True
    if ch in _PLAIN:
        return _PLAIN[ch], False
    if ch in _SHIFTED:
        return _SHIFTED[ch], True
    raise InvalidArgument(f"cannot type {ch!r}: only US-keyboard ASCII can be typed")


def key_code(name: str) -> str:
    """The qcode of a key name ("enter", "ctrl", "a", "F5" ...)."""
    lowered = name.lower()
    if lowered in NAMED_KEYS:
        return NAMED_KEYS[lowered]
    if len(name) == 1:
        code, _shift = char_key(name.lower() if name.isalpha() else name)
        return code
    raise InvalidArgument(f"unknown key {name!r}")


def _key(code: str, down: bool) -> dict[str, Any]:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": code}}}


def _btn(button: str, down: bool) -> dict[str, Any]:
    return {"type": "btn", "data": {"down": down, "button": button}}


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; BackendError if it is not a PNG."""
    if len(data) < 24 or not data.startswith(PNG_MAGIC) or data[12:16] != b"IHDR":
        raise BackendError("the screenshot QEMU wrote is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


class Display:
    """Screenshots and input of one VM, over its QMP link."""

    def __init__(self, qmp_dir: Path) -> None:
        self.qmp_dir = qmp_dir  # QEMU's own writable directory (its sockets)
        self.size: tuple[int, int] | None = None
        self._lock = asyncio.Lock()

    async def screenshot(self, qmp: Qmp) -> bytes:
        target = self.qmp_dir / f"screen-{secrets.token_hex(6)}.png"
        try:
            await qmp.execute("screendump", {"filename": str(target), "format": "png"}, timeout=30)
            data = await asyncio.to_thread(read_bounded, target, MAX_PNG)
        finally:
            target.unlink(missing_ok=True)
        self.size = png_size(data)
        return data

    async def _screen(self, qmp: Qmp) -> tuple[int, int]:
        if self.size is None:
            await self.screenshot(qmp)
        assert self.size is not None
        return self.size

    async def mouse_move(self, qmp: Qmp, x: int, y: int) -> None:
        width, height = await self._screen(qmp)
        if not (0 <= x < width and 0 <= y < height):
            raise InvalidArgument(f"({x}, {y}) is outside the {width}x{height} screen")
        sx = x * ABS_MAX // max(1, width - 1)
        sy = y * ABS_MAX // max(1, height - 1)
        await self._send(
            qmp,
            [
                {"type": "abs", "data": {"axis": "x", "value": sx}},
                {"type": "abs", "data": {"axis": "y", "value": sy}},
            ],
        )

    async def click(
        self, qmp: Qmp, button: str, *, times: int = 1, x: int | None = None, y: int | None = None
    ) -> None:
        if button not in BUTTONS:
            raise InvalidArgument(f"button must be one of {BUTTONS}, not {button!r}")
        if (x is None) != (y is None):
            raise InvalidArgument("give both x and y, or neither")
        if x is not None and y is not None:
            await self.mouse_move(qmp, x, y)
        for _ in range(times):
            await self._send(qmp, [_btn(button, True)])
            await self._send(qmp, [_btn(button, False)])

    async def scroll(self, qmp: Qmp, direction: str, amount: int) -> None:
        if direction not in ("up", "down") or not 1 <= amount <= 100:
            raise InvalidArgument("scroll direction must be up or down, amount 1-100")
        button = f"wheel-{direction}"
        for _ in range(amount):
            await self._send(qmp, [_btn(button, True)])
            await self._send(qmp, [_btn(button, False)])

    async def write(self, qmp: Qmp, text: str) -> None:
        keys = [char_key(ch) for ch in text]  # all checked before the first key is sent
        for code, shift in keys:
            events = [_key("shift", True)] if shift else []
            events += [_key(code, True), _key(code, False)]
            events += [_key("shift", False)] if shift else []
            await self._send(qmp, events)
            await asyncio.sleep(KEY_GAP)

    async def press(self, qmp: Qmp, keys: Sequence[str]) -> None:
        """One key, or a chord (all down in order, then up in reverse)."""
        if not 1 <= len(keys) <= 8:
            raise InvalidArgument("press takes 1 to 8 keys (a chord)")
        codes = [key_code(k) for k in keys]
        await self._send(qmp, [_key(c, True) for c in codes])
        await self._send(qmp, [_key(c, False) for c in reversed(codes)])

    async def _send(self, qmp: Qmp, events: list[dict[str, Any]]) -> None:
        async with self._lock:  # one input sequence at a time: chords never interleave
            await qmp.execute("input-send-event", {"events": events})


def read_bounded(path: Path, limit: int) -> bytes:
    """The file QEMU wrote, read as data only: QEMU's directory is writable by QEMU,
    so a QEMU a guest took over could have put a link or a FIFO there instead (never
    followed, never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendError(f"cannot read the screenshot QEMU wrote: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BackendError("the screenshot QEMU wrote is not a regular file")
        if st.st_size > limit:
            raise BackendError(f"the screenshot is larger than {limit} bytes")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit + 1)[:limit]
    finally:
        os.close(fd)
