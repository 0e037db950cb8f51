"""The microVM guest for real: Debian's kernel and our initramfs under QEMU (TCG), a
busybox EROFS layer and an ext4 disk, the unchanged agent reached through GuestChannel.

One VM for the whole module (a TCG boot costs seconds and everything in the guest is
slow), killed and its files removed in teardown even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.guest import channel as wire
from dsec.guest.channel import GuestChannel
from dsec.guest.initramfs import Entry, guest_initramfs, load_order, modinfo, newc_archive
from dsec.guest.kernel import guest_kernel
from dsec.images.builders import busybox_tree
from dsec.sessions.agent_client import AgentClient

QEMU = shutil.which("qemu-system-x86_64")

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(QEMU is None, reason="needs qemu-system-x86_64 (qemu-system-x86)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="builds disk images as root"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils"),
]

BOOT_ARGS = "console=ttyS0 quiet panic=-1 tsc_early_khz=2000000 lpj=4000000 pci=off"


@dataclass
class Vm:
    proc: subprocess.Popen[bytes]
    dir: Path
    chardev: Path
    listen: Path
    console: Path
    channel: GuestChannel
    boot_to_ready: float

    def console_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:]


def qemu_argv(
    kernel: Path, initrd: Path, chardev: Path, drives: list[tuple[Path, str, bool]], extra: str
) -> list[str]:
    assert QEMU is not None
    argv = [
        QEMU, "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-m", "256", "-smp", "1",
        "-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot",
        "-kernel", str(kernel), "-initrd", str(initrd), "-append", f"{BOOT_ARGS} {extra}",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={chardev},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=dsec.agent",
    ]  # fmt: skip
    for i, (image, serial, readonly) in enumerate(drives):
        ro = ",readonly=on" if readonly else ""
        argv += ["-drive", f"id=d{i},file={image},format=raw,if=none{ro}"]
        argv += ["-device", f"virtio-blk-device,drive=d{i},serial={serial}"]
    return argv


def make_disks(work: Path) -> tuple[Path, Path]:
    tree = work / "tree"
    tree.mkdir()
    busybox_tree(tree)
    layer = work / "l0.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", str(layer), str(tree)], check=True)
    shutil.rmtree(tree)
    rw = work / "rw.img"
    with open(rw, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(rw)], check=True)
    return layer, rw


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def disks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    work = tmp_path_factory.mktemp("mvm")
    try:
        layer, rw = make_disks(work)
        yield work, layer, rw
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
async def vm(disks: tuple[Path, Path, Path]) -> AsyncIterator[Vm]:
    work, layer, rw = disks
    kernel = await asyncio.to_thread(guest_kernel)
    initrd = await asyncio.to_thread(guest_initramfs)
    chardev, listen, console = work / "agent.chardev", work / "agent.sock", work / "console"
    argv = qemu_argv(
        kernel.vmlinuz,
        initrd,
        chardev,
        [(layer, "dsec-l0", True), (rw, "dsec-rw", False)],
        "dsec.layers=1 dsec.rw=1 dsec.hostname=guest1",
    )
    t0 = time.monotonic()
    with open(console, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    channel = GuestChannel(chardev, listen)
    try:
        await channel.start()
        try:
            await channel.wait_ready(60)
        except Exception:
            kill(proc)
            raise AssertionError(f"guest not ready; console:\n{console.read_text()}") from None
        yield Vm(proc, work, chardev, listen, console, channel, time.monotonic() - t0)
    finally:
        await vm_channel_close(channel)
        kill(proc)
        for path in (chardev, listen, console):
            path.unlink(missing_ok=True)


async def vm_channel_close(channel: GuestChannel) -> None:
    with contextlib.suppress(Exception):
        await channel.close()


async def sh(vm: Vm, script: str, user: str = "root", timeout: float = 60) -> tuple[int, bytes]:
    result = await AgentClient(vm.channel.listen).exec(
        ["/bin/sh", "-c", script],
        env={},
        cwd="",
        user=user,
        timeout=timeout,
        max_output=64 << 20,
        stdin=None,
    )
    return result.exit_code, result.stdout + result.stderr


async def test_boots_to_ready_and_runs_commands(vm: Vm) -> None:
    print(f"boot to READY: {vm.boot_to_ready:.2f}s")
    assert vm.channel.connected
    code, out = await sh(vm, "echo hi; id -u; hostname; cat /proc/1/comm")
    assert (code, out) == (0, b"hi\n0\nguest1\ndsec-init\n")
    code, out = await sh(vm, "id -u", user="user")
    assert (code, out.strip()) == (0, b"1000")


async def test_root_is_overlay_on_the_disk(vm: Vm) -> None:
    code, out = await sh(vm, "grep ' / ' /proc/mounts; ls /; ls /.dsec-agent.sock 2>&1")
    assert code != 0 or b"No such file" in out, out  # the agent socket is unreachable
    assert b"overlay / overlay" in out, out
    code, out = await sh(vm, "ip addr show lo 2>/dev/null | grep -c 127.0.0.1 || true")
    assert out.strip() in (b"1", b""), out


async def test_files(vm: Vm) -> None:
    agent = AgentClient(vm.channel.listen)
    data = os.urandom(300_000)
    await agent.write_file("/tmp/blob", data, user="root", mode=0o644)
    assert await agent.read_file("/tmp/blob", user="root", max_bytes=1 << 20) == data
    code, out = await sh(vm, "md5sum /tmp/blob | cut -c1-32")
    import hashlib

    assert out.strip().decode() == hashlib.md5(data).hexdigest()


async def test_large_stdout_does_not_stall_a_second_channel(vm: Vm) -> None:
    agent = AgentClient(vm.channel.listen)
    size = 8 << 20
    big = asyncio.create_task(
        agent.exec(
            ["/bin/sh", "-c", f"head -c {size} /dev/zero"],
            env={},
            cwd="",
            user="root",
            timeout=120,
            max_output=64 << 20,
            stdin=None,
        )
    )
    await asyncio.sleep(1.0)  # the big one is streaming now
    assert not big.done()
    t0 = time.monotonic()
    code, out = await sh(vm, "echo quick")
    quick = time.monotonic() - t0
    assert (code, out) == (0, b"quick\n")
    assert not big.done(), "the large output finished first: the test proves nothing"
    result = await big
    total = time.monotonic() - t0
    print(f"quick exec {quick:.2f}s while {size} bytes streamed; the stream took {total:.2f}s")
    assert result.exit_code == 0 and len(result.stdout) == size
    assert quick < total / 2


async def test_reconnect_with_a_new_channel(vm: Vm) -> None:
    await vm.channel.close()
    assert not vm.channel.connected
    vm.channel = GuestChannel(vm.chardev, vm.listen)
    await vm.channel.start()
    await vm.channel.wait_ready(30)
    code, out = await sh(vm, "echo again")
    assert (code, out) == (0, b"again\n")


async def test_disk_keeps_the_upper_layer(vm: Vm) -> None:
    code, out = await sh(vm, "echo kept > /root/mark; sync; ls /mnt 2>&1; cat /root/mark")
    assert out.endswith(b"kept\n"), out


# ------------------------------------------------------------------------------------
# a hostile guest: a fake chardev that speaks garbage after a valid HELLO


async def fake_guest(path: Path, garbage: bytes) -> tuple[asyncio.Server, asyncio.Event]:
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(wire.HDR.size + 16)
        nonce = head[wire.HDR.size + 8 :]
        writer.write(
            b"stale bytes of an older link"
            + wire.frame(wire.T_HELLO, 0, wire.HELLO_MAGIC + nonce + bytes([wire.ST_READY]))
        )
        await writer.drain()
        await asyncio.sleep(0.1)
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
    ],
    ids=["oversized", "unknown-channel", "unknown-type", "credit", "data-after-eof", "hello"],
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
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the client was closed
        writer.close()
        with pytest.raises(Exception, match="lost"):
            await channel.wait_ready(1)
    finally:
        await channel.close()
        server.close()
        await server.wait_closed()
    assert not listen.exists()
    assert "protocol violation" in caplog.text
    assert "Traceback" not in caplog.text


# ------------------------------------------------------------------------------------
# pure parts


def test_newc_archive_layout() -> None:
    blob = newc_archive([Entry("a", 0o100644, b"xyz"), Entry("dev/console", 0o20600, rdev=(5, 1))])
    assert blob.startswith(b"070701")
    assert b"TRAILER!!!\0" in blob and len(blob) % 4 == 0
    with pytest.raises(ValueError):
        newc_archive([Entry("../x", 0o100644)])


def test_module_dependencies_come_first() -> None:
    kernel = guest_kernel()
    from dsec.guest.initramfs import module_index

    index = module_index(kernel.modules)
    assert "net_failover" in modinfo(index["virtio_net"].read_bytes())["depends"].split(",")
    names = [name for _, name, _ in load_order([["virtio_console"], ["virtio_net"]], index)]
    assert names.index("virtio_ring") < names.index("virtio") < names.index("virtio_console")
    assert names.index("failover") < names.index("net_failover") < names.index("virtio_net")
