"""The microVM guest kernel: Debian's cloud kernel, fetched and unpacked by the project.

Why Debian's package and not a kernel we build: it is signed, maintained and in the same
archive as everything else install.sh uses, and its cloud flavour already has ext4,
devtmpfs and the 8250 console built in; the few virtio/erofs/overlay modules it lacks
are put into our own initramfs (dsec.guest.initramfs).

The package is fetched with ``apt-get download`` (never installed: the host's /boot and
/lib/modules are never touched) and unpacked with ``dpkg-deb -x`` under
``<cache>/kernel/<package>``. The unpack happens in a temporary directory that is
renamed into place only when complete, under a file lock, so any number of processes
can ask at once and none ever sees half a kernel.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import BackendError
from dsec.native import cache_dir

META_PACKAGE = "linux-image-cloud-amd64"
"""Debian's meta package; it depends on the versioned image package we fetch."""

_lock = threading.Lock()
_PACKAGE_RE = re.compile(r"^linux-image-[0-9][A-Za-z0-9.+~-]*-cloud-amd64$")


@dataclass(frozen=True, slots=True)
class GuestKernel:
    vmlinuz: Path
    """The bzImage QEMU's ``-kernel`` takes."""
    modules: Path
    """``lib/modules/<release>`` of the unpacked package (``kernel/**.ko`` below it)."""
    release: str
    """``uname -r`` of the guest, e.g. ``6.1.0-57-cloud-amd64``."""


def resolve_package(meta: str = META_PACKAGE) -> str:
    """The versioned image package ``meta`` depends on, from apt's local lists (no
    network: ``apt-cache depends`` only reads what ``apt-get update`` stored)."""
    override = os.environ.get("DSEC_GUEST_KERNEL_PACKAGE")
    if override:
        if not _PACKAGE_RE.match(override):
            raise BackendError(f"DSEC_GUEST_KERNEL_PACKAGE={override!r} is not a cloud kernel")
        return override
    if shutil.which("apt-cache") is None:
        raise BackendError("cannot find the guest kernel: apt-cache is not installed")
    proc = subprocess.run(
        ["apt-cache", "depends", meta], capture_output=True, text=True, check=False
    )
    for line in proc.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if key == "Depends" and _PACKAGE_RE.match(value):
            return value
    raise BackendError(
        f"cannot find the guest kernel: apt-cache depends {meta} names no versioned "
        f"kernel package (run apt-get update?): {proc.stderr.strip() or proc.stdout.strip()}"
    )


def _find(root: Path) -> GuestKernel | None:
    """The kernel in a complete unpack directory, or None."""
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        return None
    release = images[0].name.removeprefix("vmlinuz-")
    modules = root / "lib" / "modules" / release
    if not (modules / "kernel").is_dir():
        return None
    return GuestKernel(vmlinuz=images[0], modules=modules, release=release)


_resolved: dict[Path, GuestKernel] = {}


def guest_kernel() -> GuestKernel:
    """The unpacked guest kernel, fetching it the first time (blocking: seconds to a
    minute on a first call). The answer is kept for the process's life per cache dir:
    asking apt which kernel to use costs ~0.9 s, too much for every create, and a
    kernel upgrade is picked up by the next process."""
    known = _resolved.get(cache_dir())
    if known is not None and known.vmlinuz.is_file():
        return known
    found = _guest_kernel()
    _resolved[cache_dir()] = found
    return found


def _guest_kernel() -> GuestKernel:
    package = resolve_package()
    final = cache_dir() / "kernel" / package
    found = _find(final)
    if found is not None:
        return found
    with _lock:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            found = _find(final)  # another process may have fetched it meanwhile
            if found is None:
                _fetch(package, final)
                found = _find(final)
    if found is None:
        raise BackendError(f"the unpacked {package} has no boot/vmlinuz-* and lib/modules")
    return found


def _run(argv: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise BackendError(f"cannot {what}: {argv[0]} exited with {proc.returncode}: {tail}")


def _fetch(package: str, final: Path) -> None:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise BackendError(f"cannot fetch the guest kernel: {tool} is not installed")
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=final.parent))
    try:
        os.chmod(work, 0o755)  # apt's _apt user may write its download here
        _run(["apt-get", "download", "-q", package], work, f"download {package}")
        debs = sorted(work.glob("*.deb"))
        if len(debs) != 1:
            raise BackendError(f"apt-get download {package} left {len(debs)} .deb files")
        tree = work / "tree"
        _run(["dpkg-deb", "-x", str(debs[0]), str(tree)], work, f"unpack {debs[0].name}")
        if _find(tree) is None:
            raise BackendError(f"{debs[0].name} has no boot/vmlinuz-* and lib/modules")
        os.replace(tree, final)  # appears under its final name only when complete
    finally:
        shutil.rmtree(work, ignore_errors=True)
