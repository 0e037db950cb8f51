"""dsec.edge.liveview without a VM: a unix socket standing in for QEMU's VNC server and
a stub edge. Shows that bytes pass both ways unchanged, that the socket closing ends
the relay and gives the viewer's place back, that a socket nobody listens on is a
typed error that also gives it back, and that the bound counts open links."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dsec.edge.edge import Edge
from dsec.edge.liveview import LiveViews
from dsec.errors import BackendError, TooManyViewers


class StubEdge:
    """What LiveViews uses of an Edge: the record, the backend, the call, the audit."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.audited: list[str] = []
        self.audit = SimpleNamespace(
            record=lambda _sid, _kind, what, **_: self.audited.append(what)
        )

    def running_record(self, sandbox_id: str) -> Any:
        return SimpleNamespace(id=sandbox_id)

    def backend_of(self, rec: Any, capability: Any = None) -> Any:
        async def desktop_socket(_rec: Any) -> Path:
            return self.socket

        return SimpleNamespace(desktop_socket=desktop_socket)

    async def call_running(self, sandbox_id: str, op: Any) -> Any:
        return await op(SimpleNamespace(id=sandbox_id))


@contextlib.asynccontextmanager
async def vnc_server(path: Path, greeting: bytes) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """Sends ``greeting``, then echoes upper-cased whatever comes, until told to close."""
    clients: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        clients.append(writer)
        writer.write(greeting)
        while data := await reader.read(1024):
            writer.write(data.upper())
        writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    try:
        yield clients
    finally:
        server.close()
        for w in clients:
            w.close()


async def test_bytes_pass_both_ways_and_a_closed_socket_ends_the_relay(tmp_path: Path) -> None:
    sock = tmp_path / "vnc.sock"
    edge = StubEdge(sock)
    views = LiveViews(cast(Edge, edge), max_viewers=1)
    async with vnc_server(sock, b"RFB 003.008\n") as clients:
        link = await views.open("sb1")
        assert views.viewers("sb1") == 1
        with pytest.raises(TooManyViewers):
            await views.open("sb1")
        inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        sent: list[bytes] = []
        all_in = asyncio.Event()

        async def send(data: bytes) -> None:
            sent.append(data)
            if b"".join(sent) == b"RFB 003.008\n\x00\x01KEY":
                all_in.set()

        relay = asyncio.create_task(views.relay(link, inbox.get, send))
        await inbox.put(b"\x00\x01key")
        async with asyncio.timeout(5):
            await all_in.wait()  # the greeting, then the echo of what the viewer sent
        clients[0].close()  # the VM's VNC server goes away
        async with asyncio.timeout(5):
            await relay
    assert views.viewers("sb1") == 0
    assert edge.audited == ["live_view_opened", "live_view_closed"]


async def test_a_socket_nobody_listens_on_is_a_typed_error(tmp_path: Path) -> None:
    views = LiveViews(cast(Edge, StubEdge(tmp_path / "absent.sock")))
    with pytest.raises(BackendError, match="does not answer"):
        await views.open("sb1")
    assert views.viewers("sb1") == 0


async def test_a_viewer_leaving_ends_the_relay(tmp_path: Path) -> None:
    sock = tmp_path / "vnc.sock"
    views = LiveViews(cast(Edge, StubEdge(sock)))
    async with vnc_server(sock, b"x"):
        link = await views.open("sb1")

        async def gone() -> bytes | None:
            return None

        async def send(_data: bytes) -> None:
            pass

        async with asyncio.timeout(5):
            await views.relay(link, gone, send)
    assert views.viewers("sb1") == 0
