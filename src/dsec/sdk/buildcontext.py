"""What a Dockerfile's ``COPY``/``ADD`` take from a build context, planned on the client.

A context is untrusted input: every source is a path *inside* the context (``..`` and
absolute names are clamped or refused, a symlink leading out of it is refused), files
the ``.dockerignore`` excludes are neither copied nor hashed into the cache key (a
named ignored source is "not in the build context", as in Docker), and the bytes one
instruction copies are bounded (PayloadTooLarge, a 413).

Docker's source rules: a source may be a glob (``*``, ``?``, ``[...]``, matched per
path component like Go's ``filepath.Match``); a directory copies its *contents*; more
than one source (after globbing) needs a destination ending in ``/``; a destination
ending in ``/`` (or a directory source) is a directory, else the file's new path.
``ADD`` of a local tar archive (detected by content: plain, gzip, bzip2, xz) unpacks
it into the destination instead (``extract_archive``: tarfile's ``data`` filter, so no
member leaves the directory, no device nodes, no setuid; bounded in bytes and members
against decompression bombs).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, cast

from dsec.errors import InvalidArgument, PayloadTooLarge
from dsec.sdk.dockerignore import IgnoreMatcher, _compile

MAX_COPY_BYTES = 1 << 30
MAX_ARCHIVE_MEMBERS = 100_000
GLOB_CHARS = "*?["


def fail(line: int, message: str) -> InvalidArgument:
    return InvalidArgument(f"Dockerfile line {line}: {message}", line=line)


def clean_abs(workdir: str, path: str) -> str:
    """``path`` (relative to ``workdir``) as an absolute path; ``..`` stops at ``/``."""
    parts: list[str] = []
    for part in (PurePosixPath(workdir) / path).parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/" + "/".join(parts)


@dataclass
class CopyPlan:
    """Files and directories to create in the sandbox, and the content digest that
    goes into the step's cache key."""

    files: list[tuple[Path, str, int]] = field(default_factory=list)  # host, dest, mode
    dirs: list[str] = field(default_factory=list)
    digest: str = ""
    chown: str | None = None
    chmod: int | None = None
    total: int = 0


@dataclass
class CopyFlags:
    chown: str | None = None
    chmod: int | None = None
    source: str | None = None  # --from


def parse_flags(words: list[str], instruction: str, line: int) -> CopyFlags:
    """Pop ``--chown``/``--chmod``/``--from`` (COPY only) off the front of ``words``."""
    flags = CopyFlags()
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        name, sep, value = flag.partition("=")
        if not sep or not value:
            raise fail(line, f"{instruction} {name} needs a value ({name}=...)")
        if name == "--chown":
            if any(c.isspace() or c == "\x00" for c in value) or len(value) > 256:
                raise fail(line, f"bad --chown {value!r}")
            flags.chown = value
        elif name == "--chmod":
            try:
                mode = int(value, 8)
            except ValueError:
                raise fail(line, f"--chmod takes an octal mode, got {value!r}") from None
            if not 0 <= mode <= 0o7777:
                raise fail(line, f"--chmod {value!r} is out of range")
            flags.chmod = mode
        elif name == "--from" and instruction == "COPY":
            flags.source = value
        else:
            raise fail(line, f"{instruction} {name} is not supported")
    return flags


class BuildContext:
    """A context directory with its ``.dockerignore``."""

    def __init__(self, root: Path, *, ignore: IgnoreMatcher | None = None) -> None:
        self.root = root.resolve()
        self.ignore = ignore if ignore is not None else IgnoreMatcher([])

    @classmethod
    def load(cls, root: Path) -> BuildContext:
        return cls(root, ignore=IgnoreMatcher.load(root))

    def _rel(self, src: str, line: int) -> str:
        parts: list[str] = []
        for part in PurePosixPath(src).parts:
            if part == "/" or part in (".", ""):
                continue
            if part == "..":
                if not parts:
                    raise fail(line, f"{src!r} is outside the build context")
                parts.pop()
            else:
                parts.append(part)
        return "/".join(parts)

    def _inside(self, path: Path, shown: str, line: int) -> Path:
        real = path.resolve()
        if real != self.root and self.root not in real.parents:
            raise fail(line, f"{shown} links outside the build context")
        return real

    def walk(self) -> Iterator[str]:
        """Every path of the context that is not ignored (relative), parents first."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            base = os.path.relpath(dirpath, self.root)
            prefix = "" if base == "." else base + "/"
            dirnames.sort()
            keep = []
            for d in dirnames:
                rel = prefix + d
                if self.ignore.prunable(rel):
                    continue
                keep.append(d)
                if not self.ignore.excluded(rel):
                    yield rel
            dirnames[:] = keep
            for f in sorted(filenames):
                if not self.ignore.excluded(prefix + f):
                    yield prefix + f

    def sources(self, src: str, line: int) -> list[str]:
        """What a source names: itself, or every context path its glob matches."""
        rel = self._rel(src, line)
        if not any(c in rel for c in GLOB_CHARS):
            if rel and self.ignore.excluded(rel):
                raise fail(line, f"{src!r} is not in the build context (.dockerignore)")
            if not os.path.lexists(self.root / rel):
                raise fail(line, f"{src!r} is not in the build context")
            return [rel]
        regex = _compile(rel)
        found = [p for p in self.walk() if regex.match(p)]
        if not found:
            raise fail(line, f"no file in the build context matches {src!r}")
        return found

    def files(self, rel: str, line: int) -> Iterator[tuple[Path, str]]:
        """(host path, path relative to the copy root) below the source ``rel``;
        empty directories end in ``/``. Ignored paths are left out."""
        target = self._inside(self.root / rel, repr(rel), line)
        if not target.is_dir():
            if not target.is_file():
                raise fail(line, f"{rel!r} is not a regular file or directory")
            yield target, target.name
            return
        for dirpath, dirnames, filenames in os.walk(target):
            dirnames.sort()
            base = Path(dirpath)
            ctx_base = os.path.relpath(dirpath, target)
            prefix = "" if ctx_base == "." else ctx_base + "/"
            ctx_prefix = (rel + "/" if rel else "") + prefix
            kept_dirs = []
            for d in dirnames:
                if self.ignore.prunable(ctx_prefix + d):
                    continue
                kept_dirs.append(d)
            dirnames[:] = kept_dirs
            links = [d for d in dirnames if (base / d).is_symlink()]
            for name in sorted(filenames) + links:
                if self.ignore.excluded(ctx_prefix + name):
                    continue
                real = self._inside(base / name, prefix + name, line)
                if real.is_file():
                    yield real, prefix + name
            for d in dirnames:
                if self.ignore.excluded(ctx_prefix + d) or (base / d).is_symlink():
                    continue
                if not any(True for _ in (base / d).iterdir()):
                    yield base / d, prefix + d + "/"


def plan_copy(
    ctx: BuildContext,
    srcs: list[str],
    dest: str,
    workdir: str,
    flags: CopyFlags,
    line: int,
    instruction: str,
    *,
    limit: int = MAX_COPY_BYTES,
) -> CopyPlan:
    """Docker's COPY semantics over ``ctx`` (see the module docstring)."""
    rels = [r for src in srcs for r in ctx.sources(src, line)]
    into_dir = dest.endswith("/") or dest in (".", "") or dest.endswith("/.")
    if len(rels) > 1 and not into_dir:
        raise fail(line, f"{instruction} of several sources needs a destination ending in '/'")
    dest_abs = clean_abs(workdir, dest)
    plan = CopyPlan(chown=flags.chown, chmod=flags.chmod)
    h = hashlib.sha256()
    for rel in rels:
        is_dir = (ctx.root / rel).is_dir() and not (ctx.root / rel).is_symlink()
        if not is_dir and (ctx.root / rel).is_symlink():
            is_dir = ctx._inside(ctx.root / rel, repr(rel), line).is_dir()
        for host, sub in ctx.files(rel, line):
            where = f"{dest_abs.rstrip('/')}/{sub}" if is_dir or into_dir else dest_abs
            if sub.endswith("/"):
                plan.dirs.append(where.rstrip("/"))
                h.update(f"d {where}\n".encode())
                continue
            st = host.stat()
            plan.total += st.st_size
            if plan.total > limit:
                raise PayloadTooLarge(
                    f"Dockerfile line {line}: {instruction} copies more than {limit} bytes"
                )
            mode = stat.S_IMODE(st.st_mode)
            plan.files.append((host, where, mode))
            h.update(f"f {where} {mode:o} ".encode())
            h.update(file_digest(host).encode() + b"\n")
        if is_dir:
            plan.dirs.append(dest_abs)
    h.update(f"chown={flags.chown} chmod={flags.chmod}".encode())
    plan.digest = h.hexdigest()
    return plan


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(1 << 20):
            h.update(data)
    return h.hexdigest()


def archive_kind(path: Path) -> str | None:
    """The compression of a tar archive at ``path`` by its content, or None when it is
    not a tar (then ADD copies it as a file, as Docker does)."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    kind = "tar"
    if head.startswith(b"\x1f\x8b"):
        kind = "gz"
    elif head.startswith(b"BZh"):
        kind = "bz2"
    elif head.startswith(b"\xfd7zXZ\x00"):
        kind = "xz"
    try:
        with _open(path, kind) as raw, tarfile.open(fileobj=raw, mode="r|") as tf:
            first = tf.next()
            return kind if first is not None else None
    except (tarfile.TarError, OSError, EOFError, lzma.LZMAError):
        return None


def _open(path: Path, kind: str) -> IO[bytes]:
    if kind == "gz":
        return cast(IO[bytes], gzip.open(path, "rb"))
    if kind == "bz2":
        return cast(IO[bytes], bz2.open(path, "rb"))
    if kind == "xz":
        return cast(IO[bytes], lzma.open(path, "rb"))
    return open(path, "rb")


def extract_archive(path: Path, kind: str, dest: Path, line: int, *, limit: int) -> None:
    """Unpack the tar ``path`` into the new directory ``dest``, bounded: more than
    ``limit`` bytes of file data or ``MAX_ARCHIVE_MEMBERS`` members is a 413, a member
    tarfile's ``data`` filter refuses (absolute, ``..``, links out, devices) a 422."""
    dest.mkdir(parents=True)
    total = 0
    try:
        with _open(path, kind) as raw, tarfile.open(fileobj=raw, mode="r|") as tf:
            for n, member in enumerate(tf):
                if n >= MAX_ARCHIVE_MEMBERS:
                    raise PayloadTooLarge(
                        f"Dockerfile line {line}: ADD archive has over "
                        f"{MAX_ARCHIVE_MEMBERS} members"
                    )
                if member.isreg():
                    total += member.size
                    if total > limit:
                        raise PayloadTooLarge(
                            f"Dockerfile line {line}: ADD archive unpacks to more than "
                            f"{limit} bytes"
                        )
                try:
                    tf.extract(member, dest, filter="data")
                except tarfile.FilterError as exc:
                    raise fail(line, f"ADD archive member refused: {exc}") from None
                tf.members.clear()  # type: ignore[attr-defined]  # streamed: never looked back
    except KeyError as exc:  # a hard link to a member the archive did not have
        shutil.rmtree(dest, ignore_errors=True)
        raise fail(line, f"ADD archive: {exc.args[0] if exc.args else exc}") from None
    except (tarfile.TarError, EOFError, lzma.LZMAError, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        if isinstance(exc, tarfile.FilterError):
            raise fail(line, f"ADD archive member refused: {exc}") from None
        raise fail(line, f"ADD archive is not a valid tar: {exc}") from None
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
