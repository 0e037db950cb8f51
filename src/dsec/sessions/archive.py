"""Directory upload and download as tar streams, built from the agent's safe file ops.

No ``tar`` binary in the image is needed or trusted: the edge writes and parses the tar
format itself and every file, directory and link is created or read through the agent
as the sandbox user inside the sandbox's own mount namespace, so nothing can reach a
host path. Upload additionally keeps every member under the destination: absolute
names, ``..`` components, links pointing outside, and members below a link the archive
itself created are refused (422) before anything of theirs is written.
"""

from __future__ import annotations

import posixpath
import stat
import tarfile
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from dsec.errors import InvalidArgument
from dsec.sessions import protocol as p
from dsec.sessions.agent_client import AgentClient

BLOCK = 512
_ZERO = bytes(BLOCK)
MAX_ENTRIES = 1_000_000


def _pad(size: int) -> int:
    return -size % BLOCK


def _tarinfo(name: str, entry: p.Entry) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mode = stat.S_IMODE(entry.mode)
    ti.uid, ti.gid = entry.uid, entry.gid
    ti.mtime = entry.mtime_ns // 1_000_000_000
    if stat.S_ISDIR(entry.mode):
        ti.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(entry.mode):
        ti.type = tarfile.SYMTYPE
        ti.linkname = entry.target
    else:
        ti.type = tarfile.REGTYPE
        ti.size = entry.size
    return ti


def _header(ti: tarfile.TarInfo) -> bytes:
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


async def download(agent: AgentClient, root: str, *, user: str) -> AsyncIterator[bytes]:
    """A tar stream of ``root`` (a directory: its contents; a file: that file).

    Symlinks are stored as links, never followed; sockets, devices and fifos are left out.
    A file that changes size while it is read is cut or zero-padded to its listed size,
    so the archive always stays well-formed.
    """
    _, tail = await agent.fs(p.FS_STAT, root, user=user, flags=p.FS_FLAG_FOLLOW)
    (top,) = p.decode_entries(tail)
    if stat.S_ISDIR(top.mode):
        entries, _ = await agent.fs(
            p.FS_LIST, root, user=user, flags=p.FS_FLAG_RECURSIVE, limit=MAX_ENTRIES
        )
        base = root.rstrip("/") or "/"
    else:
        entries = [p.Entry(posixpath.basename(root), *_fields(top))]
        base = posixpath.dirname(root)
    for entry in entries:
        kind = stat.S_IFMT(entry.mode)
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            continue
        yield _header(_tarinfo(entry.name, entry))
        if kind != stat.S_IFREG:
            continue
        left = entry.size
        reader = agent.read_stream(posixpath.join(base, entry.name), user=user)
        try:
            async for chunk in reader:
                if len(chunk) >= left:
                    if left:
                        yield chunk[:left]
                    left = 0
                    break
                left -= len(chunk)
                yield chunk
        finally:
            await reader.aclose()
        if left:
            yield bytes(left)
        if pad := _pad(entry.size):
            yield bytes(pad)
    yield _ZERO * 2


def _fields(e: p.Entry) -> tuple[int, int, int, int, int, str]:
    return e.mode, e.uid, e.gid, e.size, e.mtime_ns, e.target


class _Stream:
    """Exact reads over an async iterator of byte chunks."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._it = aiter(chunks)
        self._buf = bytearray()

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            try:
                self._buf += await anext(self._it)
            except StopAsyncIteration:
                return False
        return True

    async def read(self, n: int) -> bytes:
        if not await self._fill(n):
            raise InvalidArgument("the tar stream ended in the middle of a member")
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def header(self) -> bytes | None:
        """The next 512-byte block, or None at a clean end of the stream."""
        if not await self._fill(BLOCK):
            if self._buf:
                raise InvalidArgument("the tar stream ended in the middle of a header")
            return None
        return await self.read(BLOCK)

    async def chunks(self, n: int) -> AsyncIterator[bytes]:
        while n > 0:
            if not self._buf and not await self._fill(1):
                raise InvalidArgument("the tar stream ended in the middle of a file")
            take = min(n, len(self._buf), 1 << 20)
            data = bytes(self._buf[:take])
            del self._buf[:take]
            n -= take
            yield data


@dataclass
class UploadStats:
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


def safe_member_name(name: str) -> str:
    """A relative, normalised member name; raises for absolute names and ``..``."""
    if name.startswith("/") or "\x00" in name:
        raise InvalidArgument(f"tar member {name[:200]!r} has an absolute path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"tar member {name[:200]!r} contains '..'")
    return "/".join(parts)


def _check_link(name: str, target: str) -> None:
    if target.startswith("/"):
        raise InvalidArgument(f"tar member {name!r} links to the absolute path {target!r}")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../"):
        raise InvalidArgument(f"tar member {name!r} links outside the destination ({target!r})")


def _pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1 : pos + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


async def upload(
    agent: AgentClient, dest: str, chunks: AsyncIterable[bytes], *, user: str
) -> UploadStats:
    """Extract a tar stream into ``dest`` (created if missing) inside the sandbox."""
    stats = UploadStats()
    src = _Stream(chunks)
    await agent.fs(p.FS_MKDIR, dest, user=user, flags=p.FS_FLAG_PARENTS, mode=0o755)
    links: set[str] = set()
    pending: dict[str, str] = {}
    while (block := await src.header()) is not None:
        if block == _ZERO:
            continue
        try:
            ti = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.TarError as exc:
            raise InvalidArgument(f"not a tar stream: {exc}") from None
        if ti.type in (
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.GNUTYPE_LONGNAME,
            tarfile.GNUTYPE_LONGLINK,
        ):
            data = await src.read(ti.size + _pad(ti.size))
            data = data[: ti.size]
            if ti.type == tarfile.XHDTYPE:
                pending.update(_pax(data))
            elif ti.type == tarfile.GNUTYPE_LONGNAME:
                pending["path"] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif ti.type == tarfile.GNUTYPE_LONGLINK:
                pending["linkpath"] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = safe_member_name(pending.pop("path", ti.name))
        linkname = pending.pop("linkpath", ti.linkname)
        size = int(pending.pop("size", ti.size)) if ti.type in tarfile.REGULAR_TYPES else 0
        pending.clear()
        if any(name == link or name.startswith(link + "/") for link in links):
            raise InvalidArgument(f"tar member {name!r} is below a symlink of the same archive")
        target = posixpath.join(dest, name) if name else dest
        if ti.type in tarfile.REGULAR_TYPES:
            written = await agent.write_stream(
                target, src.chunks(size), user=user, mode=ti.mode & 0o777, make_parents=True
            )
            stats.files += 1
            stats.bytes += written
        elif ti.type == tarfile.DIRTYPE:
            if name:
                await agent.fs(
                    p.FS_MKDIR, target, user=user, flags=p.FS_FLAG_PARENTS, mode=ti.mode & 0o777
                )
                stats.directories += 1
        elif ti.type == tarfile.SYMTYPE:
            _check_link(name, linkname)
            await agent.fs(p.FS_SYMLINK, target, user=user, path2=linkname)
            links.add(name)
            stats.symlinks += 1
        else:
            stats.skipped.append(name)
        if size and ti.type not in tarfile.REGULAR_TYPES:
            await src.read(size)
        if pad := _pad(size):
            await src.read(pad)
    return stats
