"""Build ``dsec-init`` from its C source, once per source version, into the host cache.

Compiled on the host rather than shipped as a binary so the package stays source-only;
the result is a static executable that runs in any image (no libc needed inside), keyed
by the source hash so an upgraded source never reuses a stale binary.
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

SOURCE = Path(__file__).with_name("dsec-init.c")
DEFAULT_CACHE_DIR = Path("/var/cache/dsec")
CFLAGS = ["-std=c11", "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror"]

_lock = threading.Lock()


def cache_dir() -> Path:
    """``$DSEC_CACHE_DIR`` (read on every call, so tests can redirect it) or the default."""
    return Path(os.environ.get("DSEC_CACHE_DIR") or DEFAULT_CACHE_DIR)


def source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def agent_binary() -> Path:
    """Path of the compiled agent for the current source, compiling it if needed.

    Safe to call from many threads and processes at once: a file lock serialises the
    compile, and the binary appears under its final name only when complete.
    """
    target = cache_dir() / "agent" / f"dsec-init-{source_digest()}"
    if target.is_file():
        return target
    with _lock:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not target.is_file():  # another process may have built it meanwhile
                _compile(target)
    return target


def _compile(target: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BackendError("cannot build the sandbox agent: gcc is not installed")
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
                f"cannot build the sandbox agent ({SOURCE.name}): gcc exited with "
                f"{proc.returncode}:\n{proc.stderr.strip()}"
            )
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
