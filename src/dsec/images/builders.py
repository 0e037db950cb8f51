"""Built-in images, made locally (no container registry is reachable from our hosts).

* ``busybox``: the host's static busybox plus one symlink per applet and a minimal
  /etc. About 2 MB; every file gets busybox's own mtime so the tree is the same on
  every build.
* ``debian-python``: ``debootstrap --variant=minbase --include=python3,ca-certificates``
  plus an unprivileged ``user`` (uid 1000). Bootstrapping takes minutes, so the
  finished tree is kept under ``<images>/cache/`` and only mkfs.erofs reruns on a
  rebuild (delete the cache directory to bootstrap afresh).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import stat
import struct
import subprocess
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dsec.errors import ImageBuildError
from dsec.images.extract import DEFAULT_PATH, split_member_name

HOST_BUSYBOX = Path("/bin/busybox")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Bump when the post-bootstrap customisation changes so cached trees are rebuilt.
DEBIAN_RECIPE_VERSION = 1

ProgressFn = Callable[[str, int, int | None], None]

BUSYBOX_PASSWD = """\
root:x:0:0:root:/root:/bin/sh
user:x:1000:1000:user:/home/user:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
"""
BUSYBOX_GROUP = """\
root:x:0:
user:x:1000:
nogroup:x:65534:
"""
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

BUSYBOX_CONFIG: dict[str, object] = {
    "env": {"PATH": DEFAULT_PATH},
    "workdir": "/",
    "user": "root",
}
DEBIAN_CONFIG: dict[str, object] = {
    "env": {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
    "workdir": "/",
    "user": "root",
}


def is_static_elf(path: Path) -> bool:
    """True for an ELF64 little-endian executable without a PT_INTERP (dynamic loader):
    a dynamically linked busybox would not run in an image without its libc."""
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return False
        phoff = struct.unpack_from("<Q", ident, 0x20)[0]
        phentsize, phnum = struct.unpack_from("<HH", ident, 0x36)
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
    for i in range(phnum):
        (p_type,) = struct.unpack_from("<I", table, i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def busybox_applets(busybox: Path) -> list[str]:
    """Install paths of every applet, as ``busybox --list-full`` prints them."""
    try:
        out = subprocess.run(
            [str(busybox), "--list-full"], capture_output=True, check=True, timeout=30
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError) as exc:
        raise ImageBuildError(f"cannot list the applets of {busybox}: {exc}") from exc
    applets = []
    for line in out.splitlines():
        line = line.strip()
        if line and line != "bin/busybox":
            split_member_name(line, "busybox applet")  # refuses '..' and absolute paths
            applets.append(line)
    return applets


def busybox_tree(dest: Path, busybox: Path = HOST_BUSYBOX) -> int:
    """Lay out the busybox image in the empty directory ``dest``; returns the number of
    applet links. Blocking: run it in a thread."""
    if not busybox.is_file():
        raise ImageBuildError(f"{busybox} not found: install busybox-static")
    if not is_static_elf(busybox):
        raise ImageBuildError(f"{busybox} is not a static executable: install busybox-static")
    mtime = busybox.stat().st_mtime_ns
    dirs = {
        "bin": 0o755,
        "sbin": 0o755,
        "usr": 0o755,
        "usr/bin": 0o755,
        "usr/sbin": 0o755,
        "etc": 0o755,
        "root": 0o700,
        "home": 0o755,
        "home/user": 0o755,
        "tmp": 0o1777,
        "var": 0o755,
        "var/tmp": 0o1777,
        "run": 0o755,
        "proc": 0o555,
        "sys": 0o555,
        "dev": 0o755,
    }
    os.chmod(dest, 0o755)
    for rel, mode in dirs.items():
        path = dest / rel
        path.mkdir(exist_ok=True)
        os.chmod(path, mode)
    os.chown(dest / "home/user", 1000, 1000)
    shutil.copy2(busybox, dest / "bin/busybox")
    os.chown(dest / "bin/busybox", 0, 0)
    os.chmod(dest / "bin/busybox", 0o755)
    applets = busybox_applets(busybox)
    for rel in applets:
        link = dest / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(link):
            os.symlink("/bin/busybox", link)
    files = {
        "etc/passwd": (BUSYBOX_PASSWD, 0o644),
        "etc/group": (BUSYBOX_GROUP, 0o644),
        "etc/hosts": (HOSTS, 0o644),
        "etc/resolv.conf": ("", 0o644),
    }
    for rel, (text, mode) in files.items():
        (dest / rel).write_text(text)
        os.chmod(dest / rel, mode)
    # One fixed mtime everywhere (busybox's own): rebuilding gives the same tree.
    for top, subdirs, names in os.walk(dest, topdown=False):
        for name in names + subdirs:
            os.utime(os.path.join(top, name), ns=(mtime, mtime), follow_symlinks=False)
    os.utime(dest, ns=(mtime, mtime))
    return len(applets)


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The host's Debian mirror (deb822 sources first, then sources.list)."""
    deb822 = apt_dir / "sources.list.d" / "debian.sources"
    candidates = [deb822, *sorted((apt_dir / "sources.list.d").glob("*.sources"))]
    for path in candidates:
        with contextlib.suppress(OSError):
            for stanza in re.split(r"\n\s*\n", path.read_text()):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                suites = fields.get("suites", "").split()
                if "deb" in fields.get("types", "").split() and "bookworm" in suites:
                    uris = fields.get("uris", "").split()
                    if uris:
                        return uris[0].rstrip("/")
    with contextlib.suppress(OSError):
        for line in (apt_dir / "sources.list").read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and "security" not in words[1]:
                url = next((w for w in words[1:] if "://" in w), None)
                if url:
                    return url.rstrip("/")
    return DEFAULT_MIRROR


async def run_logged(
    args: list[str],
    *,
    step: str,
    progress: ProgressFn | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run a build step; its ``I: ...`` lines become progress, its tail the error."""
    base_env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LC_ALL": "C",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    for key in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        if key in os.environ:
            base_env[key] = os.environ[key]
    base_env.update(env or {})
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=base_env,
        )
    except FileNotFoundError:
        raise ImageBuildError(f"{step}: {args[0]} is not installed", step=step) from None
    tail: deque[str] = deque(maxlen=40)
    lines = 0
    assert proc.stdout is not None
    try:
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            lines += 1
            if progress is not None and line.startswith("I: "):
                progress(f"{step}: {line[3:]}", lines, None)
        await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        text = "\n".join(tail)
        raise ImageBuildError(f"{step} failed with exit code {proc.returncode}:\n{text}", step=step)


async def debootstrap(
    dest: Path,
    *,
    suite: str = "bookworm",
    include: tuple[str, ...] = ("python3", "ca-certificates"),
    mirror: str | None = None,
    progress: ProgressFn | None = None,
) -> None:
    """debootstrap in a private mount namespace: the /proc and /sys it mounts inside
    the target vanish with it, even if it dies halfway."""
    args = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(include)}",
        suite,
        str(dest),
        mirror or debian_mirror(),
    ]
    await run_logged(args, step="debootstrap", progress=progress)


def _has_uid(tree: Path, uid: int) -> bool:
    passwd = (tree / "etc/passwd").read_text()
    return any(line.split(":")[2:3] == [str(uid)] for line in passwd.splitlines())


def _clean_debian_tree(tree: Path) -> None:
    for pattern in ("var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for path in tree.glob(pattern):
            path.unlink()
    lists = tree / "var/lib/apt/lists"
    if lists.is_dir():
        for path in lists.iterdir():
            if path.name not in ("partial", "lock"):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    # debootstrap copies the host's; the sandbox's network setup decides these.
    for rel, text in (
        ("etc/resolv.conf", ""),
        ("etc/hostname", "localhost\n"),
        ("etc/hosts", HOSTS),
    ):
        path = tree / rel
        if path.is_symlink() or (path.exists() and not stat.S_ISREG(path.lstat().st_mode)):
            path.unlink()
        path.write_text(text)
        os.chmod(path, 0o644)


async def customize_debian(tree: Path, *, progress: ProgressFn | None = None) -> None:
    """Add ``user`` (uid 1000), drop apt caches and the host's resolver/hostname."""
    if not await asyncio.to_thread(_has_uid, tree, 1000):
        if progress:
            progress("adding user 'user' (uid 1000)", 0, None)
        await run_logged(
            [
                "chroot",
                str(tree),
                "useradd",
                "--create-home",
                "--uid",
                "1000",
                "--user-group",
                "--shell",
                "/bin/bash",
                "user",
            ],
            step="useradd",
        )
    if progress:
        progress("cleaning apt caches", 0, None)
    await asyncio.to_thread(_clean_debian_tree, tree)
