"""The fullvm backend's guest agent client against a hostile guest, without QEMU.

The guest writes everything the host reads here: a reply too long, not JSON, not an
object, nested absurdly, of the wrong types, never sent, or a flood before a sync's
sentinel must each end as a typed ``GuestAgentError`` within the call's deadline (and
the next call must work again on a fresh, synced stream). A fake agent on a unix
socket plays the guest; the decoder is also tested byte by byte.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from dsec.backends.fullvm import guestops
from dsec.backends.fullvm.display import char_key, key_code, png_size, read_bounded
from dsec.backends.fullvm.qga import (
    GuestAgent,
    GuestAgentError,
    GuestCommandError,
    ReplyDecoder,
    b64,
    parse_reply,
)
from dsec.errors import BackendError, InvalidArgument, LimitExceeded

# ---- the decoder ------------------------------------------------------------------------


def test_sync_skips_everything_before_the_sentinel() -> None:
    d = ReplyDecoder()
    d.expect_sentinel()
    d.feed(b'{"return": 1}\n{"error": {"desc": "JSON parse error, stray"}}\n')
    assert d.next_reply() is None  # stale: before the 0xFF
    d.feed(b'\xff{"return": 42}\n{"return": {"pid": 7}}\n')
    assert d.next_reply() == {"return": 42}
    assert d.next_reply() == {"return": {"pid": 7}}
    assert d.next_reply() is None


def test_a_sentinel_mid_line_resets_the_parser() -> None:
    d = ReplyDecoder()
    d.feed(b'{"retu\xff{"return": 3}\n')
    assert d.next_reply() == {"return": 3}


def test_answers_split_across_reads() -> None:
    d = ReplyDecoder()
    for byte in b'{"return": {"count": 5}}\n':
        d.feed(bytes([byte]))
    assert d.next_reply() == {"return": {"count": 5}}


def test_an_oversized_line_is_refused_before_it_is_complete() -> None:
    d = ReplyDecoder(max_line=1024)
    d.feed(b'{"return": "' + b"a" * 2000)
    with pytest.raises(GuestAgentError, match="longer than 1024"):
        d.next_reply()


def test_a_flood_before_the_sentinel_is_bounded() -> None:
    d = ReplyDecoder(max_discard=4096)
    d.expect_sentinel()
    with pytest.raises(GuestAgentError, match="more than 4096 bytes"):
        for _ in range(10):
            d.feed(b"x" * 1000)


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1, 2, 3]",
        b'"just a string"',
        b'{"neither": 1}',
        b"\xfe\xfd garbage \x00",
        b"[" * 100_000 + b"]" * 100_000,  # deep nesting: RecursionError, not a crash
    ],
    ids=["text", "list", "string", "no-return", "binary", "deep"],
)
def test_malformed_answers_are_typed_errors(line: bytes) -> None:
    with pytest.raises(GuestAgentError):
        parse_reply(line)


def test_blank_lines_are_skipped() -> None:
    d = ReplyDecoder()
    d.feed(b'\n  \n{"return": {}}\n')
    assert d.next_reply() == {"return": {}}


def test_base64_is_strict_and_bounded() -> None:
    assert b64(base64.b64encode(b"hi").decode(), "x", 10) == b"hi"
    with pytest.raises(GuestAgentError):
        b64("!!!!", "x", 10)
    with pytest.raises(GuestAgentError):
        b64(base64.b64encode(b"a" * 100).decode(), "x", 10)
    with pytest.raises(GuestAgentError):
        b64(12, "x", 10)


# ---- the client against a fake guest agent ------------------------------------------

Handler = Callable[[dict[str, object], asyncio.StreamWriter], Awaitable[None]]


async def _serve(path: Path, handler: Handler) -> asyncio.Server:
    """A fake qemu-ga: answers syncs properly, hands every other request to ``handler``."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                line = line.replace(b"\xff", b"")
                if not line.strip():
                    continue
                req = json.loads(line)
                if req["execute"] == "guest-sync-delimited":
                    ident = req["arguments"]["id"]
                    writer.write(
                        b'{"return": 999}\n\xff' + json.dumps({"return": ident}).encode() + b"\n"
                    )
                    await writer.drain()
                    continue
                await handler(req, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_unix_server(client, path=str(path))


@pytest.fixture
async def socket_path(tmp_path: Path) -> AsyncIterator[Path]:
    yield tmp_path / "ga.sock"


async def _reply(writer: asyncio.StreamWriter, doc: object) -> None:
    writer.write(json.dumps(doc).encode() + b"\n")
    await writer.drain()


async def test_exec_roundtrip_and_file_io(socket_path: Path) -> None:
    files: dict[int, bytearray] = {}

    async def handler(req: dict[str, object], w: asyncio.StreamWriter) -> None:
        cmd, args = req["execute"], req.get("arguments")
        assert isinstance(args, dict)
        if cmd == "guest-exec":
            await _reply(w, {"return": {"pid": 5}})
        elif cmd == "guest-exec-status":
            out = base64.b64encode(b"hello\n").decode()
            await _reply(w, {"return": {"exited": True, "exitcode": 3, "out-data": out}})
        elif cmd == "guest-file-open":
            files[7] = bytearray(b"file content")
            await _reply(w, {"return": 7})
        elif cmd == "guest-file-read":
            data = bytes(files[7][: args["count"]])
            del files[7][: args["count"]]
            buf = base64.b64encode(data).decode()
            await _reply(w, {"return": {"count": len(data), "buf-b64": buf, "eof": not files[7]}})
        elif cmd == "guest-file-close":
            await _reply(w, {"return": {}})

    server = await _serve(socket_path, handler)
    agent = GuestAgent(socket_path)
    try:
        done = await guestops.run(
            agent, ["/bin/sh", "-c", "x"], env={}, stdin=None, timeout=5, max_output=1000
        )
        assert (done.exit_code, done.stdout, done.stderr) == (3, b"hello\n", b"")
        assert await guestops.read_file(agent, "/f", max_bytes=100) == b"file content"
        files.clear()
        with pytest.raises(LimitExceeded):
            await guestops.read_file(agent, "/f", max_bytes=4)
    finally:
        await agent.close()
        server.close()


async def _hostile(socket_path: Path, answer: bytes, max_line: int = 1 << 20) -> GuestAgentError:
    """The agent answers the first real command with ``answer``; the call must fail
    typed within its deadline and the next call must succeed on a new stream."""
    sent = {"n": 0}

    async def handler(req: dict[str, object], w: asyncio.StreamWriter) -> None:
        sent["n"] += 1
        if sent["n"] == 1:
            w.write(answer)
            await w.drain()
            if not answer.endswith(b"\n"):
                await asyncio.sleep(30)  # never finishes the line
        else:
            await _reply(w, {"return": {}})

    server = await _serve(socket_path, handler)
    agent = GuestAgent(socket_path, max_line=max_line)
    try:
        t0 = time.monotonic()
        with pytest.raises(GuestAgentError) as err:
            await agent.call("guest-ping", timeout=3)
        assert time.monotonic() - t0 < 10
        assert await agent.call("guest-ping", timeout=3) == {}  # reconnected and synced
        return err.value
    finally:
        await agent.close()
        server.close()


async def test_an_oversized_answer_fails_the_call_only(socket_path: Path) -> None:
    err = await _hostile(socket_path, b'{"return": "' + b"A" * (2 << 20) + b'"}\n')
    assert "longer than" in err.message


async def test_garbage_fails_the_call_only(socket_path: Path) -> None:
    err = await _hostile(socket_path, b"\x00\x01garbage{{{\n")
    assert "not JSON" in err.message


async def test_a_silent_agent_times_out(socket_path: Path) -> None:
    err = await _hostile(socket_path, b'{"return": ')
    assert "did not answer" in err.message


async def test_wrong_types_are_protocol_errors(socket_path: Path) -> None:
    async def handler(req: dict[str, object], w: asyncio.StreamWriter) -> None:
        if req["execute"] == "guest-exec":
            await _reply(w, {"return": {"pid": "seven"}})

    server = await _serve(socket_path, handler)
    agent = GuestAgent(socket_path)
    try:
        with pytest.raises(GuestAgentError, match="pid"):
            await guestops.run(agent, ["x"], env={}, stdin=None, timeout=5, max_output=10)
    finally:
        await agent.close()
        server.close()


async def test_an_agent_error_is_a_command_error(socket_path: Path) -> None:
    async def handler(req: dict[str, object], w: asyncio.StreamWriter) -> None:
        await _reply(w, {"error": {"class": "GenericError", "desc": "no such file" + "x" * 5000}})

    server = await _serve(socket_path, handler)
    agent = GuestAgent(socket_path)
    try:
        with pytest.raises(GuestCommandError) as err:
            await agent.call("guest-file-open", {"path": "/nope", "mode": "r"})
        assert len(err.value.message) < 700  # the guest's text is cut short
        assert isinstance(err.value, BackendError)
    finally:
        await agent.close()
        server.close()


async def test_no_agent_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(GuestAgentError, match="cannot connect"):
        await GuestAgent(tmp_path / "absent.sock").call("guest-ping", timeout=1)


# ---- computer-use helpers ---------------------------------------------------------------


def test_typing_maps_us_keyboard_characters() -> None:
    assert char_key("a") == ("a", False)
    assert char_key("A") == ("a", True)
    assert char_key("!") == ("1", True)
    assert char_key(" ") == ("spc", False)
    with pytest.raises(InvalidArgument):
        char_key("é")
    assert key_code("Enter") == "ret"
    assert key_code("ctrl") == "ctrl"
    assert key_code("C") == "c"
    with pytest.raises(InvalidArgument):
        key_code("hyper")


def test_png_size_reads_the_header_only() -> None:
    header = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + (720).to_bytes(4, "big")
    assert png_size(header + (400).to_bytes(4, "big")) == (720, 400)
    with pytest.raises(BackendError):
        png_size(b"GIF89a" + b"\x00" * 30)


def test_a_screenshot_path_qemu_replaced_is_never_followed_or_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "screen.png"
    os.mkfifo(fifo)
    with pytest.raises(BackendError, match="not a regular file"):
        read_bounded(fifo, 1024)  # returns at once: no writer is waited for
    fifo.unlink()
    (tmp_path / "secret").write_bytes(b"host file")
    fifo.symlink_to(tmp_path / "secret")
    with pytest.raises(BackendError, match="cannot read"):
        read_bounded(fifo, 1024)
