"""Turning archives into a root file system tree: rootfs tars, `docker save`, OCI layouts.

We extract ourselves instead of using ``tarfile.extractall`` because layers need
whiteouts applied against the layers below them, and because every path must resolve
*inside* the tree the way it would inside the container (a symlink ``/lib -> usr/lib``
in a lower layer is followed within the tree, never out to the host's /usr/lib).
Absolute member names, ``..`` components and links escaping the tree are refused.
Everything runs as root and keeps numeric ownership, modes, xattrs, device nodes, hard
links and nanosecond mtimes, so mkfs.erofs sees exactly what the image author built.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import platform
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import IO, Any, Literal

from dsec.errors import ImageBuildError, InvalidArgument

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_SYMLINK_HOPS = 40
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

ArchiveKind = Literal["tar", "docker", "oci"]
# (step, done, total) like dsec.images.service.Progress
ProgressFn = Callable[[str, int, int | None], None]

INDEX_MEDIA_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}


def default_config() -> dict[str, object]:
    """What an image without a config runs with."""
    return {"env": {"PATH": DEFAULT_PATH}, "workdir": "/", "user": "root"}


def split_member_name(name: str, what: str = "archive member") -> list[str]:
    """Path components of a tar member name; refuses absolute names and ``..``."""
    if name.startswith("/"):
        raise InvalidArgument(f"{what} {name!r} has an absolute path; refusing to extract it")
    if "\x00" in name:
        raise InvalidArgument(f"{what} {name!r} contains a NUL byte")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"{what} {name!r} contains '..'; refusing path traversal")
    return parts


def forget_members(tf: tarfile.TarFile) -> None:
    """Drop the headers tarfile keeps of every member read so far: we never look back,
    and a rootfs tar can hold hundreds of thousands of them."""
    tf.members.clear()  # type: ignore[attr-defined]


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def mtime_ns(member: tarfile.TarInfo) -> int:
    """Exact nanoseconds: a pax ``mtime`` header is parsed as a decimal, not a float."""
    raw = member.pax_headers.get("mtime")
    if raw:
        with contextlib.suppress(InvalidOperation, ValueError):
            return int(Decimal(raw) * 1_000_000_000)
    return int(Decimal(str(member.mtime)) * 1_000_000_000)


@dataclass
class TreeWriter:
    """Applies tar layers, bottom first, onto the directory ``root``.

    Call :meth:`apply` once per layer, then :meth:`finish` to set directory mtimes
    (they change whenever an entry is added below them, so they are set last).
    """

    root: Path
    entries: int = 0
    _dir_times: dict[str, int] = field(default_factory=dict)
    _layer: set[str] = field(default_factory=set)
    _layer_ancestors: set[str] = field(default_factory=set)

    def apply(
        self,
        tf: tarfile.TarFile,
        *,
        whiteouts: bool,
        on_entry: Callable[[int], None] | None = None,
    ) -> None:
        # Whiteouts only hide what lower layers added: remember this layer's own paths.
        self._layer = set()
        self._layer_ancestors = set()
        while (member := tf.next()) is not None:
            self._apply_member(tf, member, whiteouts=whiteouts)
            # Stream mode keeps every header it has read; we never look back.
            forget_members(tf)
            self.entries += 1
            if on_entry is not None and self.entries % 1000 == 0:
                on_entry(self.entries)

    def finish(self) -> None:
        for rel, ns in sorted(self._dir_times.items(), key=lambda kv: -kv[0].count("/")):
            path = self._host(rel)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    os.utime(path, ns=(ns, ns), follow_symlinks=False)

    # -- one member --

    def _apply_member(self, tf: tarfile.TarFile, m: tarfile.TarInfo, *, whiteouts: bool) -> None:
        parts = split_member_name(m.name)
        if not parts:  # "./": the root directory itself
            if m.isdir():
                self._set_meta(self._host(""), "", m)
            return
        base = parts[-1]
        if whiteouts and base.startswith(WHITEOUT):
            self._whiteout(parts, m.name)
            return
        parent = self._resolve_dir(parts[:-1], create=True)
        assert parent is not None
        rel = _join("/".join(parent), base)
        path = self._host(rel)
        self._mark(rel)
        try:
            existing: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            existing = None

        if m.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                self._remove(rel, existing)
                existing = None
            if existing is None:
                os.mkdir(path, 0o700)
            self._set_meta(path, rel, m)
        elif m.isreg():
            if existing is not None:
                self._remove(rel, existing)
            self._write_file(tf, m, path)
            self._set_meta(path, rel, m)
        elif m.issym():
            self._check_symlink(parent, m.linkname, m.name)
            if existing is not None:
                self._remove(rel, existing)
            os.symlink(m.linkname, path)
            self._set_meta(path, rel, m)
        elif m.islnk():
            target = self._hardlink_target(m)
            if target == path:
                return
            if existing is not None:
                self._remove(rel, existing)
            os.link(target, path, follow_symlinks=False)
        elif m.ischr() or m.isblk() or m.isfifo():
            if existing is not None:
                self._remove(rel, existing)
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK if m.isblk() else stat.S_IFIFO
            os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            self._set_meta(path, rel, m)
        else:
            log.warning("skipping archive member %r of unsupported type %r", m.name, m.type)

    def _write_file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        src = tf.extractfile(m)
        if src is None:  # pragma: no cover - isreg() members always have data
            raise ImageBuildError(f"cannot read archive member {m.name!r}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with src, open(os.open(path, flags, 0o600), "wb", closefd=True) as out:
            shutil.copyfileobj(src, out, CHUNK)

    def _set_meta(self, path: str, rel: str, m: tarfile.TarInfo) -> None:
        # chown first: it clears setuid bits and file capabilities set before it.
        os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not m.issym():
            os.chmod(path, m.mode & 0o7777)
        for key, value in m.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                name = key.removeprefix("SCHILY.xattr.")
                try:
                    raw = value.encode("utf-8", "surrogateescape")
                    os.setxattr(path, name, raw, follow_symlinks=False)
                except OSError as exc:
                    log.warning("cannot set xattr %s on %s: %s", name, m.name, exc.strerror)
        ns = mtime_ns(m)
        if m.isdir():
            self._dir_times[rel] = ns
        else:
            os.utime(path, ns=(ns, ns), follow_symlinks=False)

    # -- paths --

    def _host(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else os.fspath(self.root)

    def _mark(self, rel: str) -> None:
        self._layer.add(rel)
        head = rel
        while (cut := head.rfind("/")) > 0:
            head = head[:cut]
            if head in self._layer_ancestors:
                break
            self._layer_ancestors.add(head)
        self._layer_ancestors.add("")

    def _resolve_dir(self, parts: list[str], *, create: bool) -> list[str] | None:
        """Resolve directory components inside the tree like a chroot would.

        Symlinks are followed with the tree as ``/`` and ``..`` stops at the top, so no
        path can leave the tree. Missing directories are created (mode 0755, root)
        when ``create`` is set; otherwise None is returned for a missing one.
        """
        done: list[str] = []
        todo = list(reversed(parts))
        hops = 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            path = self._host(_join("/".join(done), part))
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(path, 0o755)
                done.append(part)
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise InvalidArgument(f"too many levels of symbolic links at {path!r}")
                target = os.readlink(path)
                if target.startswith("/"):
                    done = []
                todo.extend(reversed(target.split("/")))
            elif stat.S_ISDIR(st.st_mode):
                done.append(part)
            else:
                rel = _join("/".join(done), part)
                raise ImageBuildError(f"archive path component {rel!r} is not a directory")
        return done

    @staticmethod
    def _check_symlink(parent: list[str], target: str, name: str) -> None:
        """Absolute targets are fine (they resolve inside the image); relative ones
        must not climb above the top of the tree."""
        if not target or "\x00" in target:
            raise InvalidArgument(f"symlink {name!r} has an empty or NUL-containing target")
        if target.startswith("/"):
            return
        depth = len(parent)
        for part in target.split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    raise InvalidArgument(
                        f"symlink {name!r} -> {target!r} points outside the image tree"
                    )
            elif part not in ("", "."):
                depth += 1

    def _hardlink_target(self, m: tarfile.TarInfo) -> str:
        parts = split_member_name(m.linkname, "hard link target")
        if not parts:
            raise InvalidArgument(f"hard link {m.name!r} points at the tree root")
        parent = self._resolve_dir(parts[:-1], create=False)
        if parent is None:
            raise ImageBuildError(f"hard link {m.name!r}: target {m.linkname!r} does not exist")
        target = self._host(_join("/".join(parent), parts[-1]))
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            raise ImageBuildError(
                f"hard link {m.name!r}: target {m.linkname!r} does not exist"
            ) from None
        if stat.S_ISDIR(st.st_mode):
            raise InvalidArgument(f"hard link {m.name!r} points at a directory")
        return target

    def _remove(self, rel: str, st: os.stat_result) -> None:
        path = self._host(rel)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
            prefix = rel + "/"
            for key in [k for k in self._dir_times if k == rel or k.startswith(prefix)]:
                del self._dir_times[key]
        else:
            os.unlink(path)

    # -- whiteouts --

    def _whiteout(self, parts: list[str], name: str) -> None:
        base = parts[-1]
        parent = self._resolve_dir(parts[:-1], create=False)
        if parent is None:
            return  # nothing below to hide
        prel = "/".join(parent)
        if base == OPAQUE:
            self._remove_lower(prel, contents_only=True)
        elif base.startswith(WHITEOUT + WHITEOUT):
            return  # other AUFS metadata (.wh..wh.plnk, .wh..wh.aufs): not content
        else:
            target = base.removeprefix(WHITEOUT)
            if target in ("", ".", ".."):
                raise InvalidArgument(f"invalid whiteout {name!r}")
            self._remove_lower(_join(prel, target), contents_only=False)

    def _remove_lower(self, rel: str, *, contents_only: bool) -> None:
        """Remove what lower layers put at ``rel``, keeping what this layer added."""
        path = self._host(rel)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not contents_only and rel not in self._layer_ancestors:
            if rel not in self._layer:
                self._remove(rel, st)
            return
        if stat.S_ISDIR(st.st_mode):
            for child in os.listdir(path):
                self._remove_lower(_join(rel, child), contents_only=False)


# -- whole archives --


@dataclass
class Unpacked:
    kind: ArchiveKind
    config: dict[str, object]
    layers: int
    entries: int


def detect_compression(path: Path) -> str | None:
    with open(path, "rb") as fh:
        head = fh.read(6)
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"BZh"):
        return "bzip2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    return None


def _open_compressed(src: Path, kind: str) -> io.BufferedIOBase:
    if kind == "gzip":
        return gzip.open(src, "rb")
    if kind == "bzip2":
        return bz2.open(src, "rb")
    if kind == "xz":
        return lzma.open(src, "rb")
    raise ImageBuildError(
        f"{kind}-compressed archives are not supported; decompress it first "
        "(for example `zstd -d`) and import the plain tar"
    )


def decompress(src: Path, dest: Path, kind: str) -> None:
    """Stream-decompress to a plain tar so that members can be read at random."""
    try:
        with _open_compressed(src, kind) as fin, open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise ImageBuildError(f"cannot decompress the {kind} archive: {exc}") from exc


class HashingReader(io.RawIOBase):
    """Hashes what tarfile reads so a layer blob can be checked against its digest."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.hash = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self._raw.read(len(buf))
        n = len(data)
        buf[:n] = data
        self.hash.update(data)
        self.size += n
        return n


def _archive_index(tf: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Members that may matter to a docker/OCI archive, by normalized name; a rootfs tar's
    thousands of members are scanned but not kept."""
    index: dict[str, tarfile.TarInfo] = {}
    while (m := tf.next()) is not None:
        forget_members(tf)
        name = posixpath.normpath(m.name.lstrip("/"))
        depth = name.count("/")
        if (
            depth == 0
            or (depth == 1 and name.endswith(("/layer.tar", "/json")))
            or (depth == 2 and name.startswith("blobs/"))
        ):
            index[name] = m
    return index


class _Archive:
    """Random access to the members of a plain tar holding an image (docker/OCI)."""

    def __init__(self, tf: tarfile.TarFile, index: dict[str, tarfile.TarInfo]) -> None:
        self.tf = tf
        self.index = index

    def member(self, name: str) -> tarfile.TarInfo:
        name = posixpath.normpath(name)
        for _ in range(MAX_SYMLINK_HOPS):
            if name.startswith(("../", "/")) or name == "..":
                raise InvalidArgument(f"image archive entry {name!r} points outside the archive")
            info = self.index.get(name)
            if info is None:
                raise ImageBuildError(f"the image archive has no entry {name!r}")
            if info.isreg():
                return info
            if info.issym():
                name = posixpath.normpath(posixpath.join(posixpath.dirname(name), info.linkname))
            elif info.islnk():
                name = posixpath.normpath(info.linkname)
            else:
                raise ImageBuildError(f"image archive entry {name!r} is not a file")
        raise ImageBuildError(f"too many links resolving {name!r} in the image archive")

    def open(self, name: str) -> IO[bytes]:
        f = self.tf.extractfile(self.member(name))
        if f is None:  # pragma: no cover
            raise ImageBuildError(f"cannot read {name!r} from the image archive")
        return f

    def json(self, name: str, limit: int = 16 << 20) -> Any:
        info = self.member(name)
        if info.size > limit:
            raise ImageBuildError(f"{name!r} in the image archive is too large for a JSON file")
        with self.open(name) as fh:
            try:
                return json.loads(fh.read())
            except ValueError as exc:
                raise ImageBuildError(f"{name!r} in the image archive is not JSON: {exc}") from exc


def _blob_name(digest: object) -> str:
    if not isinstance(digest, str):
        raise ImageBuildError(f"invalid digest {digest!r} in the image archive")
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ImageBuildError(f"unsupported or invalid digest {digest!r} in the image archive")
    return f"blobs/sha256/{hexpart}"


def _host_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _pick_manifest(arc: _Archive, index: Any, depth: int = 0) -> dict[str, Any]:
    """Follow index.json (and nested indexes) to one image manifest for this host."""
    if depth > 4:
        raise ImageBuildError("image indexes nest too deeply")
    entries = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ImageBuildError("the OCI index lists no manifests")
    chosen = entries[0]
    for entry in entries:
        plat = entry.get("platform") if isinstance(entry, dict) else None
        if (
            isinstance(plat, dict)
            and plat.get("os", "linux") == "linux"
            and plat.get("architecture") == _host_arch()
        ):
            chosen = entry
            break
    if not isinstance(chosen, dict):
        raise ImageBuildError("invalid manifest descriptor in the OCI index")
    doc = arc.json(_blob_name(chosen.get("digest")))
    if chosen.get("mediaType") in INDEX_MEDIA_TYPES or (
        isinstance(doc, dict) and "manifests" in doc and "layers" not in doc
    ):
        return _pick_manifest(arc, doc, depth + 1)
    if not isinstance(doc, dict):
        raise ImageBuildError("the OCI manifest is not a JSON object")
    return doc


MAX_CONFIG_ITEMS = 1024  # labels or exposed ports kept from one image config
MAX_CONFIG_STR = 4096


def _short_str(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_CONFIG_STR else None


def _recorded_config(cfg: dict[str, Any], out: dict[str, object]) -> None:
    """What an image config records for whoever runs it (Labels, ExposedPorts, Shell,
    StopSignal, Healthcheck), bounded and type-checked: a registry's config is
    untrusted, and a Dockerfile ``FROM`` inherits these."""
    labels = cfg.get("Labels")
    if isinstance(labels, dict):
        kept = {k: v for k, v in labels.items() if _short_str(k) and _short_str(v) is not None}
        out["labels"] = dict(list(kept.items())[:MAX_CONFIG_ITEMS])
    ports = cfg.get("ExposedPorts")
    if isinstance(ports, dict):
        out["exposed_ports"] = [p for p in ports if _short_str(p)][:MAX_CONFIG_ITEMS]
    shell = cfg.get("Shell")
    if isinstance(shell, list) and shell and all(_short_str(x) for x in shell[:16]):
        out["shell"] = [str(x) for x in shell[:16]]
    signal = _short_str(cfg.get("StopSignal"))
    if signal and len(signal) <= 32:
        out["stop_signal"] = signal
    health = cfg.get("Healthcheck")
    test = health.get("Test") if isinstance(health, dict) else None
    if isinstance(health, dict) and isinstance(test, list) and all(_short_str(x) for x in test):
        check: dict[str, object] = {"test": [str(x) for x in test[:64]]}
        for key, name in (
            ("Interval", "interval"),
            ("Timeout", "timeout"),
            ("StartPeriod", "start_period"),
            ("StartInterval", "start_interval"),
        ):
            ns = health.get(key)
            if isinstance(ns, int) and 0 < ns < 10**15:
                check[name] = ns / 1e9
        retries = health.get("Retries")
        if isinstance(retries, int) and 0 < retries <= 1000:
            check["retries"] = retries
        out["healthcheck"] = check


def image_config(raw: Any) -> dict[str, object]:
    """Env, WorkingDir, User, Entrypoint and Cmd of an OCI/docker image config (what a
    sandbox runs with), and what it records (see ``_recorded_config``)."""
    out = default_config()
    cfg = raw.get("config") if isinstance(raw, dict) else None
    if not isinstance(cfg, dict):
        return out
    env: dict[str, str] = {}
    for item in cfg.get("Env") or []:
        key, sep, val = str(item).partition("=")
        if sep and key:
            env[key] = val
    env.setdefault("PATH", DEFAULT_PATH)
    out["env"] = env
    workdir = cfg.get("WorkingDir")
    if isinstance(workdir, str) and workdir:
        out["workdir"] = workdir if workdir.startswith("/") else "/" + workdir
    user = cfg.get("User")
    if isinstance(user, str) and user:
        out["user"] = user
    for key, name in (("Entrypoint", "entrypoint"), ("Cmd", "cmd")):
        value = cfg.get(key)
        if isinstance(value, list) and value:
            out[name] = [str(v) for v in value]
    _recorded_config(cfg, out)
    return out


def _apply_layer(
    writer: TreeWriter,
    stream: IO[bytes],
    *,
    what: str,
    digest: str | None,
    on_entry: Callable[[int], None] | None,
) -> None:
    hashing = HashingReader(stream)
    buffered = io.BufferedReader(hashing, CHUNK)
    if buffered.peek(4)[:4] == b"\x28\xb5\x2f\xfd":
        raise ImageBuildError(f"{what} is zstd-compressed, which is not supported yet")
    try:
        with tarfile.open(fileobj=buffered, mode="r|*") as layer:
            writer.apply(layer, whiteouts=True, on_entry=on_entry)
    except tarfile.TarError as exc:
        raise ImageBuildError(f"{what} is not a valid tar archive: {exc}") from exc
    if digest is not None:
        while buffered.read(CHUNK):
            pass
        actual = f"sha256:{hashing.hash.hexdigest()}"
        if actual != digest:
            raise ImageBuildError(
                f"{what} does not match its digest {digest} (got {actual}); the archive is damaged",
                digest=digest,
                actual=actual,
            )


@contextlib.contextmanager
def _open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    try:
        with tarfile.open(path, mode="r:") as tf:
            yield tf
    except tarfile.TarError as exc:
        raise ImageBuildError(f"the upload is not a valid tar archive: {exc}") from exc


def unpack_archive(
    archive: Path,
    rootfs: Path,
    *,
    fmt: Literal["auto", "tar", "oci"],
    scratch: Path,
    ref_hint: str | None = None,
    progress: ProgressFn | None = None,
) -> Unpacked:
    """Extract ``archive`` (any format, maybe compressed) into the empty dir ``rootfs``.

    ``scratch`` is a directory on the same disk for a decompressed copy. Blocking: run
    it in a thread.
    """
    compression = detect_compression(archive)
    if compression is not None:
        if progress:
            progress(f"decompressing {compression} archive", 0, None)
        plain = scratch / "archive.tar"
        decompress(archive, plain, compression)
        archive = plain
    with _open_tar(archive) as tf:
        index = _archive_index(tf)
        if fmt == "tar":
            kind: ArchiveKind = "tar"
        elif "manifest.json" in index:
            kind = "docker"
        elif "index.json" in index:
            kind = "oci"
        elif fmt == "oci":
            raise ImageBuildError(
                "not an OCI archive: neither manifest.json (docker save) nor index.json "
                "(OCI image layout) is at the top of the tar"
            )
        else:
            kind = "tar"

    writer = TreeWriter(rootfs)

    def on_entry(n: int) -> None:
        if progress:
            progress("extracting", n, None)

    if kind == "tar":
        with _open_tar(archive) as tf:
            writer.apply(tf, whiteouts=False, on_entry=on_entry)
        writer.finish()
        return Unpacked("tar", {}, 1, writer.entries)

    with _open_tar(archive) as tf:
        arc = _Archive(tf, index)
        layers: list[tuple[str, str | None]] = []  # (member name, expected digest)
        if kind == "docker":
            manifests = arc.json("manifest.json")
            if not isinstance(manifests, list) or not manifests:
                raise ImageBuildError("manifest.json of the docker archive lists no image")
            entry = manifests[0]
            if ref_hint is not None:
                for cand in manifests:
                    if isinstance(cand, dict) and ref_hint in (cand.get("RepoTags") or []):
                        entry = cand
                        break
            if not isinstance(entry, dict) or not isinstance(entry.get("Layers"), list):
                raise ImageBuildError("manifest.json of the docker archive has no Layers list")
            config_raw = arc.json(str(entry.get("Config", "")))
            for name in entry["Layers"]:
                name = str(name)
                norm = posixpath.normpath(name)
                expected = None
                if norm.startswith("blobs/sha256/"):
                    expected = "sha256:" + norm.rsplit("/", 1)[1]
                layers.append((name, expected))
        else:
            manifest = _pick_manifest(arc, arc.json("index.json"))
            cdesc = manifest.get("config")
            if not isinstance(cdesc, dict):
                raise ImageBuildError("the OCI manifest has no config descriptor")
            config_raw = arc.json(_blob_name(cdesc.get("digest")))
            descs = manifest.get("layers")
            if not isinstance(descs, list):
                raise ImageBuildError("the OCI manifest has no layers list")
            for desc in descs:
                if not isinstance(desc, dict):
                    raise ImageBuildError("invalid layer descriptor in the OCI manifest")
                digest = desc.get("digest")
                layers.append((_blob_name(digest), str(digest)))
        for i, (name, expected) in enumerate(layers):
            if progress:
                progress(f"applying layer {i + 1}/{len(layers)}", i, len(layers))
            with arc.open(name) as stream:
                _apply_layer(
                    writer,
                    stream,
                    what=f"layer {i + 1} ({name})",
                    digest=expected,
                    on_entry=on_entry,
                )
    writer.finish()
    return Unpacked(kind, image_config(config_raw), len(layers), writer.entries)
