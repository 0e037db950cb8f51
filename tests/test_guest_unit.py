"""The host-side pieces of the microVM guest that need no VM: the newc writer, module
dependencies, boot parameters, the kernel fetch's errors and GuestChannel against a
hostile fake guest (tests/test_microvm_guest.py boots the real thing)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
from pathlib import Path

import pytest

from dsec.errors import BackendError, InvalidArgument
from dsec.guest import channel as wire
from dsec.guest.bootparams import BASE_ARGS, BootParams
from dsec.guest.channel import GuestChannel, HoldWatch
from dsec.guest.initramfs import Entry, load_order, modinfo, module_index, newc_archive
from dsec.guest.kernel import guest_kernel

needs_kernel = pytest.mark.skipif(
    shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
    reason="fetches Debian's kernel package",
)


def test_newc_archive_layout() -> None:
    blob = newc_archive([Entry("a", 0o100644, b"xyz"), Entry("dev/console", 0o20600, rdev=(5, 1))])
    assert blob.startswith(b"070701")
    assert b"TRAILER!!!\0" in blob and len(blob) % 4 == 0
    with pytest.raises(ValueError):
        newc_archive([Entry("../x", 0o100644)])


@needs_kernel
@pytest.mark.root
def test_module_dependencies_come_first() -> None:
    kernel = guest_kernel()
    index = module_index(kernel.modules)
    assert "net_failover" in modinfo(index["virtio_net"].read_bytes())["depends"].split(",")
    names = [name for _, name, _ in load_order([["virtio_console"], ["virtio_net"]], index)]
    assert names.index("virtio_ring") < names.index("virtio") < names.index("virtio_console")
    assert names.index("failover") < names.index("net_failover") < names.index("virtio_net")


def test_kernel_fetch_failure_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DSEC_GUEST_KERNEL_PACKAGE", "linux-image-0.0.0-0-cloud-amd64")
    with pytest.raises(BackendError, match=r"cannot download linux-image-0\.0\.0-0-cloud-amd64"):
        guest_kernel()
    assert [p.name for p in (tmp_path / "kernel").iterdir()] == [".lock"]  # nothing half-made
    monkeypatch.setenv("DSEC_GUEST_KERNEL_PACKAGE", "../../etc")
    with pytest.raises(BackendError, match="not a cloud kernel"):
        guest_kernel()
    shutil.rmtree(tmp_path / "kernel")


def test_boot_params_are_checked_on_the_host() -> None:
    boot = BootParams(layers=2, rw=True, ip="10.0.2.15/24", gw="10.0.2.2", hostname="guest1")
    assert boot.cmdline() == (
        f"{BASE_ARGS} dsec.layers=2 dsec.rw=1 dsec.ip=10.0.2.15/24 dsec.gw=10.0.2.2 "
        "dsec.hostname=guest1"
    )
    for bad in (
        {"layers": 0},
        {"ip": "10.0.2.15"},
        {"ip": "10.0.2.300/24"},
        {"gw": "10.0.2.2"},
        {"hostname": "a b"},
    ):
        with pytest.raises(InvalidArgument):
            BootParams(**{"layers": 1, "rw": False, **bad})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------
# a hostile guest: a fake chardev that speaks garbage after a valid HELLO


async def fake_guest(path: Path, garbage: bytes) -> tuple[asyncio.Server, asyncio.Event]:
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(len(wire.PREAMBLE) + wire.HDR.size + 16)
        assert not any(head[: len(wire.PREAMBLE)])
        nonce = head[-8:]
        writer.write(
            b"stale bytes of an older link"
            + wire.frame(wire.T_HELLO, 0, wire.HELLO_MAGIC + nonce + bytes([wire.ST_READY]))
        )
        await writer.drain()
        opened = await reader.readexactly(wire.HDR.size)  # the test's client
        assert opened == wire.frame(wire.T_OPEN, 1)
        writer.write(garbage)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()  # until the host closes the link
        done.set()
        writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    return server, done


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack("<BII", ord("D"), 1, 1 << 30),  # oversized length
        wire.frame(wire.T_DATA, 77, b"x"),  # a channel never opened
        wire.frame(ord("Z"), 0, b""),  # unknown type
        wire.frame(wire.T_CREDIT, 1, b"\xff\xff\xff\xff"),  # credit past the window
        wire.frame(wire.T_EOF, 1) + wire.frame(wire.T_DATA, 1, b"y"),  # data after EOF
        wire.frame(wire.T_HELLO, 0, wire.HELLO_MAGIC + bytes(9)),  # HELLO of another link
        # 1 MiB without waiting for CREDIT, to a client that reads nothing: at most the
        # socket buffers' worth is passed on, the rest overruns the 256 KiB window
        wire.frame(wire.T_DATA, 1, b"w" * 65536) * 16,
    ],
    ids=[
        "oversized",
        "unknown-channel",
        "unknown-type",
        "credit",
        "data-after-eof",
        "hello",
        "window",
    ],
)
async def test_hostile_guest_frames_close_the_link(
    tmp_path: Path, garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    chardev, listen = tmp_path / "chardev", tmp_path / "listen"
    server, done = await fake_guest(chardev, garbage)
    channel = GuestChannel(chardev, listen)
    try:
        await channel.start()
        await channel.wait_ready(5)
        # a client whose channel 1 exists (so the window and credit cases reach it)
        reader, writer = await asyncio.open_unix_connection(str(listen))
        await asyncio.wait_for(done.wait(), 5)
        assert not channel.connected
        received = await asyncio.wait_for(reader.read(), 5)  # ends: the client was closed
        assert len(received) <= 2 * wire.WINDOW
        writer.close()
        with pytest.raises(Exception, match="lost"):
            await channel.wait_ready(1)
    finally:
        await channel.close()
        server.close()
        await server.wait_closed()
        chardev.unlink(missing_ok=True)
    assert not listen.exists()
    assert "protocol violation" in caplog.text
    assert "Traceback" not in caplog.text


async def quiet_guest(path: Path, *, takes_requests: bool) -> asyncio.Server:
    """A guest that answers HELLO and then either credits what it is sent (a running
    mux whose agent stays silent: a long command) or reads it and says nothing (a
    stopped mux: the bytes sit in the port's buffers)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(len(wire.PREAMBLE) + wire.HDR.size + 16)
        nonce = head[-8:]
        writer.write(wire.frame(wire.T_HELLO, 0, wire.HELLO_MAGIC + nonce + bytes([2])))
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                type_, cid, n = wire.HDR.unpack(await reader.readexactly(wire.HDR.size))
                await reader.readexactly(n)
                if type_ == wire.T_DATA and takes_requests:
                    writer.write(wire.frame(wire.T_CREDIT, cid, struct.pack("<I", n)))
                    await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(serve, str(path))


@pytest.mark.parametrize("takes_requests", [True, False], ids=["mux-runs", "mux-stopped"])
async def test_a_request_the_guest_never_takes_shows_as_stalled(
    tmp_path: Path, takes_requests: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "STALL_AFTER", 0.3)
    chardev, listen = tmp_path / "chardev", tmp_path / "listen"
    server = await quiet_guest(chardev, takes_requests=takes_requests)
    channel = GuestChannel(chardev, listen)
    try:
        await channel.start()
        await channel.wait_ready(5)
        assert channel.stalled_for() == 0.0
        _, idle_writer = await asyncio.open_unix_connection(str(listen))
        reader, writer = await asyncio.open_unix_connection(str(listen))
        writer.write(b"a request")  # the idle client sent nothing: nothing is owed
        await writer.drain()
        await asyncio.sleep(0.5)
        if takes_requests:
            assert channel.stalled_for() == 0.0  # credited, though no answer came
            assert channel.stalled() is None
        else:
            assert 0.3 < channel.stalled_for() < 5
            assert "took no request" in (channel.stalled() or "")
            channel.restart_waits()  # held (a pause): the window starts again
            assert channel.stalled() is None
            channel.abandon("stalled")
            assert channel.lost == "stalled"
            assert await asyncio.wait_for(reader.read(), 5) == b""  # its client is closed
        for w in (writer, idle_writer):
            w.close()
    finally:
        await channel.close()
        server.close()
        await server.wait_closed()


def test_a_hold_restarts_the_stall_window_once_at_the_first_free_sight() -> None:
    holds = HoldWatch()
    assert not holds.freed("a")  # never held: nothing to restart
    holds.held("a")
    holds.held("a")  # seen held on several polls: still one hold
    holds.held("b")
    holds.keep(["a"])  # b's VM is gone
    assert holds.freed("a")
    assert not holds.freed("a")  # once per hold
    assert not holds.freed("b")


def test_sockets_in_a_vmm_writable_directory_are_never_reached_through_a_link(
    tmp_path: Path,
) -> None:
    """``linux.socket_path_nofollow``: the edge connects to what a jailed QEMU creates
    in a directory QEMU can write; a symlink planted there (to any other socket of the
    host) or a file in the socket's place is refused, a real socket connects."""
    import errno
    import socket as socketmod

    from dsec.linux import socket_path_nofollow

    target = tmp_path / "elsewhere.sock"
    server = socketmod.socket(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
    server.bind(str(target))
    server.listen(1)
    try:
        planted = tmp_path / "qmp.sock"
        planted.symlink_to(target)
        with pytest.raises(OSError) as link, socket_path_nofollow(planted):
            pass  # O_PATH|O_NOFOLLOW opens the link itself: not a socket
        assert link.value.errno == errno.ENOTSOCK
        regular = tmp_path / "vnc.sock"
        regular.write_bytes(b"")
        with pytest.raises(OSError) as notsock, socket_path_nofollow(regular):
            pass
        assert notsock.value.errno == errno.ENOTSOCK
        with socket_path_nofollow(target) as safe:
            client = socketmod.socket(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
            client.connect(safe)
        conn, _ = server.accept()
        client.sendall(b"hi")
        assert conn.recv(2) == b"hi"
        conn.close()
        client.close()
    finally:
        server.close()
