"""Static C probes that benchmarks run inside sandboxes (bench/*_probe.c).

Static, so they run in any image (busybox has no glibc of the host's version); built
here with the host's gcc at the start of a run, never committed as binaries."""

from __future__ import annotations

import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def static_binary(source: str, out_dir: Path) -> bytes:
    """``bench/<source>`` compiled with ``gcc -static -O2`` in ``out_dir``; raises
    ``OSError`` (no gcc) or ``CalledProcessError`` (its message in ``stderr``)."""
    out = out_dir / Path(source).stem
    subprocess.run(
        ["gcc", "-static", "-O2", "-o", str(out), str(BENCH / source)],
        check=True,
        capture_output=True,
    )
    return out.read_bytes()
