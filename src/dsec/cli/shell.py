"""`dsec sandbox shell ID`: an interactive terminal in a sandbox (PTY over WebSocket).

The local terminal goes to raw mode, so every key (Ctrl-C included) reaches the
sandbox's shell; window size changes follow through SIGWINCH. The exit code is the
shell's. Without a terminal on stdin, input is sent as is and end of input ends the shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import termios
import tty
from typing import Annotated

import typer

from dsec.cli.common import globals_of
from dsec.sdk import DSecClient


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return size.lines or 24, size.columns or 80


async def interactive(
    url: str | None,
    api_key: str | None,
    sandbox_id: str,
    command: str | None,
    *,
    stdin_fd: int = 0,
    stdout_fd: int = 1,
) -> int:
    """Connect stdin/stdout to a terminal in the sandbox until its shell ends."""
    client = DSecClient(url, api_key)
    is_tty = os.isatty(stdin_fd)
    saved = termios.tcgetattr(stdin_fd) if is_tty else None
    loop = asyncio.get_running_loop()
    try:
        sandbox = await client.get(sandbox_id)
        rows, cols = _size(stdout_fd if os.isatty(stdout_fd) else stdin_fd)
        pty = await sandbox.pty(rows=rows, cols=cols, command=command)
        keys: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            try:
                data = os.read(stdin_fd, 65536)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(stdin_fd)
            keys.put_nowait(data)

        async def forward() -> None:
            while data := await keys.get():
                await pty.write(data)
            await pty.write(b"\x04")  # end of input: Ctrl-D for the shell

        if is_tty:
            tty.setraw(stdin_fd)
            loop.add_signal_handler(
                signal.SIGWINCH,
                lambda: asyncio.ensure_future(pty.resize(*_size(stdout_fd))),
            )
        loop.add_reader(stdin_fd, readable)
        sender = asyncio.create_task(forward())
        try:
            while data := await pty.read():
                os.write(stdout_fd, data)
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            await pty.close()
        return pty.exit.exit_code if pty.exit is not None else 1
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(stdin_fd)
        if is_tty:
            loop.remove_signal_handler(signal.SIGWINCH)
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        await client.close()


def shell(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    command: Annotated[
        str | None, typer.Option("--command", "-c", help="run this instead of /bin/sh")
    ] = None,
) -> None:
    """Open an interactive terminal in a sandbox (exit the shell to leave)."""
    g = globals_of(ctx)
    code = asyncio.run(interactive(g.url, g.api_key, sandbox_id, command))
    raise typer.Exit(code)
