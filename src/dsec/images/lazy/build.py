"""Build ``dsec-lazyfs`` from its C source once per source version (like the agent).

Dynamically linked on purpose: it runs on the host, never in a sandbox, and loads
libcrypto's SHA-NI SHA-256 with dlopen when it can (a portable one is built in).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from dsec.agent.build import cache_dir
from dsec.errors import BackendError

SOURCE = Path(__file__).with_name("dsec-lazyfs.c")
CFLAGS = ["-std=gnu11", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror"]

_lock = threading.Lock()


def lazyfs_binary() -> Path:
    """Path of the compiled daemon for the current source, compiling it if needed."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = cache_dir() / "lazyfs" / f"dsec-lazyfs-{digest}"
    if target.is_file():
        return target
    with _lock:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not target.is_file():
                _compile(target)
    return target


def _compile(target: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BackendError("cannot build the lazy layer daemon: gcc is not installed")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run(
            [gcc, *CFLAGS, "-o", str(tmp), str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise BackendError(
                f"cannot build {SOURCE.name}: gcc exited with {proc.returncode}:\n"
                f"{proc.stderr.strip()}"
            )
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
