"""The microVM initramfs: dsec-vminit as /init, the agent, and the kernel modules.

Why our own initramfs: the guest needs exactly five things before the sandbox's root
exists (devtmpfs, the virtio modules, the erofs/overlay modules, the agent channel and
the agent binary), and a distribution initramfs would bring a shell, udev and seconds
of boot for none of them. The host has no ``cpio``, so the "newc" archive is written
here (stdlib only).

Layout of the image::

    /init              dsec-vminit (src/dsec/agent/dsec-vminit.c), the guest's pid 1
    /dsec-init         the unchanged sandbox agent, exec'd by /init after the root switch
    /dsec-untrusted    the verify step's $DSEC_UNTRUSTED helper (dsec-untrusted.c), which a
                       verifier VM's /init copies to /.dsec/untrusted (others delete it)
    /dev/console       so the kernel can give /init the serial console as fds 0-2
    /modules/NAME.ko   every module below, dependencies included
    /modules.list      load order, one "PHASE NAME.ko" per line; phase 0 is loaded
                       before the agent channel is needed, phase 1 only after the boot
                       parameters are known (template mode: after GO), because it
                       probes the drives and the network card

Dependencies come from each module's ``.modinfo`` ELF section (``depends=a,b``): the
package has no modules.dep and the host has no modinfo. The archive is cached under
``<cache>/initramfs/`` by a hash of every input (both binaries, every module file and
the load list), so a changed agent or kernel never reuses a stale image.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.agent.build import agent_binary, untrusted_binary, vminit_binary
from dsec.errors import BackendError
from dsec.guest.kernel import GuestKernel, guest_kernel
from dsec.native import cache_dir

FORMAT_VERSION = "1"
"""Bumped when the image layout changes, so old cached images are not reused."""

CHANNEL_MODULES = ("virtio_mmio", "virtio_console")
"""Phase 0: what /init needs to reach the host over the agent channel."""
DEVICE_MODULES = ("virtio_blk", "virtio_net", "erofs", "overlay")
"""Phase 1: drives, network and the file systems of the sandbox's root."""

_lock = threading.Lock()


# ------------------------------------------------------------------------------------
# newc writer


@dataclass(frozen=True, slots=True)
class Entry:
    """One archive member. ``data`` is the file content (regular files) or the link
    target (symlinks); ``rdev`` is (major, minor) of a device node."""

    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def newc_archive(entries: Iterable[Entry]) -> bytes:
    """A "newc" (SVR4, no CRC) cpio archive of ``entries``, owned by root, mtime 0 so
    the same inputs give the same bytes. Parents must come before their children."""
    out = bytearray()
    for ino, entry in enumerate([*entries, Entry("TRAILER!!!", 0)], start=1):
        name = entry.name.lstrip("/").encode() + b"\0"
        if len(name) > 4096 or b"/../" in b"/" + name:
            raise ValueError(f"bad archive member name {entry.name!r}")
        nlink = 2 if stat.S_ISDIR(entry.mode) else 1
        fields = (
            ino, entry.mode, 0, 0, nlink, 0, len(entry.data),
            0, 0, entry.rdev[0], entry.rdev[1], len(name), 0,
        )  # fmt: skip
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        out += header + name + _pad4(len(header) + len(name))
        out += entry.data + _pad4(len(entry.data))
    return bytes(out)


# ------------------------------------------------------------------------------------
# modules


def modinfo(ko: bytes) -> dict[str, str]:
    """The ``key=value`` strings of an ELF64 module's ``.modinfo`` section (the first
    value of a repeated key wins, which is all we read: name and depends)."""
    if ko[:4] != b"\x7fELF" or ko[4] != 2 or ko[5] != 1:
        raise BackendError("not a little-endian ELF64 kernel module")
    shoff, = struct.unpack_from("<Q", ko, 0x28)  # fmt: skip
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ko, 0x3A)
    if shentsize < 64 or shstrndx >= shnum or shoff + shnum * shentsize > len(ko):
        raise BackendError("kernel module has a bad section table")

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", ko, shoff + i * shentsize
        )
        if off + size > len(ko):
            raise BackendError("kernel module section runs past the end of the file")
        return name, off, size

    _, stroff, strsize = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = ko.find(b"\0", stroff + name, stroff + strsize)
        if ko[stroff + name : end] == b".modinfo":
            info: dict[str, str] = {}
            for item in ko[off : off + size].split(b"\0"):
                key, eq, value = item.decode("utf-8", "replace").partition("=")
                if eq and key not in info:
                    info[key] = value
            return info
    return {}


def module_index(modules: Path) -> dict[str, Path]:
    """Module name (underscores, as ``depends=`` spells it) -> its .ko file."""
    index: dict[str, Path] = {}
    for ko in sorted((modules / "kernel").rglob("*.ko")):
        index.setdefault(ko.name.removesuffix(".ko").replace("-", "_"), ko)
    return index


def load_order(
    phases: Sequence[Sequence[str]], index: dict[str, Path]
) -> list[tuple[int, str, bytes]]:
    """(phase, name, content) of every module the phases' roots need, dependencies
    first; a module already loaded in an earlier phase is not repeated."""
    order: list[tuple[int, str, bytes]] = []
    seen: set[str] = set()

    def visit(name: str, phase: int, path: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in path:
            raise BackendError(f"kernel modules depend on each other in a cycle: {path}")
        ko = index.get(name)
        if ko is None:
            raise BackendError(f"the guest kernel has no module {name!r}")
        data = ko.read_bytes()
        for dep in filter(None, modinfo(data).get("depends", "").split(",")):
            visit(dep.replace("-", "_"), phase, (*path, name))
        seen.add(name)
        order.append((phase, name, data))

    for phase, roots in enumerate(phases):
        for root in roots:
            visit(root, phase, ())
    return order


# ------------------------------------------------------------------------------------
# the image


def build_entries(
    vminit: bytes, agent: bytes, kernel: GuestKernel, untrusted: bytes = b""
) -> list[Entry]:
    order = load_order([CHANNEL_MODULES, DEVICE_MODULES], module_index(kernel.modules))
    listing = "".join(f"{phase} {name}.ko\n" for phase, name, _ in order)
    entries = [
        Entry("init", stat.S_IFREG | 0o755, vminit),
        Entry("dsec-init", stat.S_IFREG | 0o755, agent),
        *([Entry("dsec-untrusted", stat.S_IFREG | 0o755, untrusted)] if untrusted else []),
        Entry("dev", stat.S_IFDIR | 0o755),
        Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        Entry("modules", stat.S_IFDIR | 0o700),
        Entry("modules.list", stat.S_IFREG | 0o600, listing.encode()),
    ]
    entries += [Entry(f"modules/{name}.ko", stat.S_IFREG | 0o600, data) for _, name, data in order]
    return entries


_built: dict[tuple[Path, Path, Path, Path], Path] = {}


def guest_initramfs() -> Path:
    """Path of the initramfs for the current agent, vminit and kernel, building it if
    needed (blocking; compiles the two binaries and fetches the kernel on first use;
    afterwards a few stats: the answer is remembered per set of input files, whose
    cached names already carry their content hashes)."""
    kernel = guest_kernel()
    vminit_path, agent_path, untrusted_path = vminit_binary(), agent_binary(), untrusted_binary()
    key = (vminit_path, agent_path, untrusted_path, kernel.modules)
    known = _built.get(key)
    if known is not None and known.is_file():
        return known
    vminit, agent = vminit_path.read_bytes(), agent_path.read_bytes()
    entries = build_entries(vminit, agent, kernel, untrusted_path.read_bytes())
    digest = hashlib.sha256(FORMAT_VERSION.encode())
    for entry in entries:
        digest.update(b"%s\0%o\0%d\0" % (entry.name.encode(), entry.mode, len(entry.data)))
        digest.update(entry.data)
    target = cache_dir() / "initramfs" / f"initramfs-{digest.hexdigest()[:16]}.cpio"
    if not target.is_file():
        _write(target, entries)
    _built[key] = target
    return target


def _write(target: Path, entries: list[Entry]) -> None:
    with _lock:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not target.is_file():
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_bytes(newc_archive(entries))
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
