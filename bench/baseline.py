"""An older revision of this tree, checked out beside it, for A/B benchmarks.

A platform started with ``PYTHONPATH=<tree>/src`` runs the baseline's code (its own
agent binary is compiled from its own sources, cached by hash), so both sides run at
once on the same host and a bench can interleave them.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-bench-base-"))
    path.rmdir()
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(path, ignore_errors=True)
