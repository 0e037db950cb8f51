"""Compile the project's small C programs on the host, once per source version.

Shipped as source so the package stays source-only; each binary is cached under
``$DSEC_CACHE_DIR`` (default /var/cache/dsec) keyed by the hash of its source, so an
upgraded source never reuses a stale binary. Safe from many threads and processes at
once: a file lock serialises the compile and the binary appears under its final name
only when complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from dsec.errors import BackendError

DEFAULT_CACHE_DIR = Path("/var/cache/dsec")

_lock = threading.Lock()


def cache_dir() -> Path:
    """``$DSEC_CACHE_DIR`` (read on every call, so tests can redirect it) or the default."""
    return Path(os.environ.get("DSEC_CACHE_DIR") or DEFAULT_CACHE_DIR)


def source_digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def binary(
    source: Path,
    *,
    name: str,
    subdir: str,
    cflags: list[str],
    what: str,
    libs: tuple[str, ...] = (),
) -> Path:
    """Path of ``source`` compiled with ``cflags`` (and linked with ``libs``, which go
    after the source so the linker keeps them), compiling it if needed."""
    target = cache_dir() / subdir / f"{name}-{source_digest(source)}"
    if target.is_file():
        return target
    with _lock:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not target.is_file():  # another process may have built it meanwhile
                _compile(source, target, cflags, what, libs)
    return target


def _compile(
    source: Path, target: Path, cflags: list[str], what: str, libs: tuple[str, ...] = ()
) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BackendError(f"cannot build {what}: gcc is not installed (apt-get install gcc)")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run(
            [gcc, *cflags, "-o", str(tmp), str(source), *libs],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise BackendError(
                f"cannot build {what} ({source.name}): gcc exited with "
                f"{proc.returncode}:\n{proc.stderr.strip()}"
            )
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
