"""Protected paths: grader and answer files the agent cannot read, even as root.

The content is simply *not in the agent's sandbox*: no mount, no file, nothing a
hostile root could reach through /proc/<pid>/root, /proc/1/fd, symlinks or mount
tricks. It exists on the host only (a layer's EROFS mount, or inline files written to
the sandbox's host directory, 0700 root) and is bind-mounted read-only into the
short-lived verifier container that ``verify`` starts (dsec.backends.container.verifier).

In the agent's sandbox each protected path is a read-only *decoy*: a per-sandbox
directory on the host mirroring the names (empty files), bind-mounted at the path. One
inotify fd per edge watches every decoy directory; inotify is inode-based, so an open
from any namespace is seen, and the watch descriptor names the sandbox. Opening a
decoy raises ``EventKind.PROTECTED_PATH``, so a trainer can discard the rollout.

Also here: the cgroup freezer, which holds the agent still while a verifier reads its
writable layer (overlayfs must not see a lower layer change under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.api.events import EventKind, Severity
from dsec.api.protected import ProtectedMount
from dsec.errors import BackendError
from dsec.resources.cgroups import CgroupHost
from dsec.security.audit import AuditSink

log = logging.getLogger(__name__)

# A layer's tree is mirrored into the decoy up to this many entries (names only).
MAX_DECOY_ENTRIES = 4096
# One event per sandbox and path per this many seconds; repeats are counted.
EVENT_INTERVAL = 1.0

IN_ACCESS = 0x00000001
IN_OPEN = 0x00000020
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


@dataclass(frozen=True)
class Prepared:
    """One protected path of a sandbox, on the host: what verifiers see (``source``)
    and what the agent sees (``decoy``)."""

    path: str
    source: str
    decoy: str
    digest: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "decoy": self.decoy,
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Prepared:
        return cls(str(d["path"]), str(d["source"]), str(d["decoy"]), d.get("digest"))


def _write_inline(dest: Path, files: dict[str, str]) -> None:
    dest.mkdir(mode=0o755, parents=True)
    for name, content in files.items():
        target = dest / name
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(content.encode())


def mirror_names(src: Path, dest: Path, limit: int = MAX_DECOY_ENTRIES) -> int:
    """Directories and empty look-alike files with the names under ``src`` (the real
    content never enters the decoy). Stops after ``limit`` entries; returns the count."""
    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
    count = 0
    for dirpath, dirs, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        here = dest if rel == "." else dest / rel
        for d in dirs:
            if count >= limit:
                dirs.clear()
                return count
            (here / d).mkdir(mode=0o755, exist_ok=True)
            count += 1
        for f in files:
            if count >= limit:
                return count
            with contextlib.suppress(FileExistsError):
                os.close(os.open(here / f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
            count += 1
    return count


def prepare(
    root: Path, mounts: list[ProtectedMount], layers: list[tuple[str, Path] | None]
) -> list[Prepared]:
    """Write inline content and build the decoys under the sandbox's host directory
    ``root`` (never visible inside: only ``root/rootfs`` is). ``layers`` holds the
    (digest, host mount point) of each layer-backed mount. Blocking, ~1 ms."""
    out: list[Prepared] = []
    hidden = root / "protected"
    decoys = root / "decoy"
    if mounts:
        hidden.mkdir(mode=0o700)
        decoys.mkdir(mode=0o755)
    for i, (m, layer) in enumerate(zip(mounts, layers, strict=True)):
        digest: str | None = None
        if layer is not None:
            digest, source = layer
        else:
            source = hidden / str(i)
            _write_inline(source, m.files)
        decoy = decoys / str(i)
        mirror_names(source, decoy)
        out.append(Prepared(m.path, str(source), str(decoy), digest))
    return out


def decoy_mounts(prepared: list[Prepared]) -> list[dict[str, Any]]:
    """OCI mounts for the agent's sandbox: each decoy read-only at its path."""
    return [_bind(p.decoy, p.path) for p in prepared]


def verifier_mounts(prepared: list[Prepared]) -> list[dict[str, Any]]:
    """OCI mounts for a verifier: the real content read-only at each path."""
    return [_bind(p.source, p.path) for p in prepared]


def _bind(source: str, dest: str) -> dict[str, Any]:
    return {
        "destination": dest,
        "type": "bind",
        "source": source,
        "options": ["bind", "ro", "nosuid", "nodev"],
    }


class DecoyWatcher:
    """One inotify fd for the edge; watch descriptors per sandbox, removed at teardown.

    The edge must stop watching before it walks or deletes a decoy itself, or its own
    opens would be reported (``unwatch`` first in every teardown path).
    """

    def __init__(self, audit: AuditSink) -> None:
        self.audit = audit
        self._fd = -1
        self._wds: dict[int, tuple[str, str]] = {}  # wd -> (sandbox id, path inside)
        self._by_sandbox: dict[str, list[int]] = {}
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise BackendError(f"inotify_init1: {os.strerror(err)}", errno=err)
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._drain)

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
        self._fd = -1
        self._wds.clear()
        self._by_sandbox.clear()
        self._last.clear()

    def watching(self, sandbox_id: str) -> int:
        return len(self._by_sandbox.get(sandbox_id, []))

    def watch(self, sandbox_id: str, prepared: list[Prepared]) -> None:
        """Watch every directory of the sandbox's decoys (children's opens included)."""
        if self._fd < 0 or not prepared:
            return
        self.unwatch(sandbox_id)
        wds = self._by_sandbox.setdefault(sandbox_id, [])
        for p in prepared:
            for dirpath, _dirs, _files in os.walk(p.decoy):
                rel = os.path.relpath(dirpath, p.decoy)
                inside = p.path if rel == "." else f"{p.path}/{rel}"
                wd = _libc.inotify_add_watch(
                    self._fd,
                    os.fsencode(dirpath),
                    IN_OPEN | IN_ACCESS | IN_ONLYDIR | IN_DONT_FOLLOW,
                )
                if wd < 0:
                    err = ctypes.get_errno()
                    log.warning("cannot watch decoy %s: %s", dirpath, os.strerror(err))
                    continue
                self._wds[wd] = (sandbox_id, inside)
                wds.append(wd)

    def unwatch(self, sandbox_id: str) -> None:
        for wd in self._by_sandbox.pop(sandbox_id, []):
            self._wds.pop(wd, None)
            if self._fd >= 0:
                _libc.inotify_rm_watch(self._fd, wd)
        for key in [k for k in self._last if k[0] == sandbox_id]:
            del self._last[key]

    def _drain(self) -> None:
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("inotify read failed: %s", exc)
                return
            if not buf:
                return
            self._parse(buf)

    def _parse(self, buf: bytes) -> None:
        off = 0
        while off + _EVENT.size <= len(buf):
            wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
            name = buf[off + _EVENT.size : off + _EVENT.size + length].rstrip(b"\0")
            off += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                log.warning("inotify queue overflow: some protected-path touches were not seen")
                continue
            if mask & IN_IGNORED:
                self._wds.pop(wd, None)
                continue
            owner = self._wds.get(wd)
            if owner is None:
                continue
            sandbox_id, inside = owner
            path = f"{inside}/{os.fsdecode(name)}" if name else inside
            if mask & IN_ISDIR:
                # Listing (a `find /` or `grep -r` passing by): suspicious, not proof.
                self._report(sandbox_id, path, "list", Severity.WARNING)
            else:
                self._report(
                    sandbox_id, path, "open" if mask & IN_OPEN else "read", Severity.CRITICAL
                )

    def _report(self, sandbox_id: str, path: str, op: str, severity: Severity) -> None:
        now = time.monotonic()
        key = (sandbox_id, path)
        last, repeats = self._last.get(key, (0.0, 0))
        if now - last < EVENT_INTERVAL:
            self._last[key] = (last, repeats + 1)
            return
        self._last[key] = (now, 0)
        detail: dict[str, Any] = {"path": path, "op": op}
        if repeats:
            detail["repeats"] = repeats
        self.audit.event(sandbox_id, EventKind.PROTECTED_PATH, severity=severity, **detail)


# ---- the freezer -----------------------------------------------------------------------


def _freezer(host: CgroupHost, rel: str) -> tuple[Path, str, str, Path, str]:
    """(file to write, freeze value, thaw value, file to read, frozen marker)."""
    rel = rel.strip("/")
    if "freezer" in host.v1:
        state = host.v1["freezer"] / rel / "freezer.state"
        return state, "FROZEN", "THAWED", state, "FROZEN"
    if host.v2 is not None:
        d = host.v2 / rel
        return d / "cgroup.freeze", "1", "0", d / "cgroup.events", "frozen 1"
    raise BackendError("this host has no cgroup freezer (v1 freezer or v2 cgroup.freeze)")


def freeze(host: CgroupHost, rel: str, *, timeout: float = 5.0) -> None:
    """Stop every process of the cgroup (0.1-0.2 ms); waits until the kernel says so."""
    write, on, off, read, marker = _freezer(host, rel)
    try:
        write.write_text(on)
    except OSError as exc:
        raise BackendError(f"cannot freeze {rel}: {exc.strerror}") from exc
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            if marker in read.read_text():
                return
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                write.write_text(off)
            raise BackendError(f"cgroup {rel} did not freeze within {timeout:g}s")
        time.sleep(0.0005)


def thaw(host: CgroupHost, rel: str) -> None:
    write, _on, off, _read, _marker = _freezer(host, rel)
    with contextlib.suppress(FileNotFoundError):  # the sandbox is gone: nothing to thaw
        write.write_text(off)


def is_frozen(host: CgroupHost, rel: str) -> bool:
    _write, _on, _off, read, marker = _freezer(host, rel)
    try:
        return marker in read.read_text()
    except OSError:
        return False


@contextlib.contextmanager
def frozen(host: CgroupHost, rel: str) -> Iterator[None]:
    """Frozen inside the block, thawed after it however it ends."""
    freeze(host, rel)
    try:
        yield
    finally:
        thaw(host, rel)


def redact_files(mounts: list[ProtectedMount]) -> list[ProtectedMount]:
    """The same mounts with inline contents blanked: what is stored and echoed back
    (the names stay, so a caller still sees what it asked for)."""
    return [
        m.model_copy(update={"files": dict.fromkeys(m.files, "")}) if m.files else m for m in mounts
    ]


def protected_summary(mounts: list[ProtectedMount]) -> list[dict[str, Any]]:
    """What the audit log keeps of them: paths and sources, never inline contents."""
    return [
        {"path": m.path, "layer": str(m.layer)}
        if m.layer is not None
        else {"path": m.path, "files": len(m.files)}
        for m in mounts
    ]
