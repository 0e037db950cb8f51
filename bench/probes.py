"""Probes the benchmarks use: static C probes run inside sandboxes (bench/*_probe.c),
and what each of the host's cores still gives a busy loop (``spin_capacity``).

The C probes are static, so they run in any image (busybox has no glibc of the host's
version); built here with the host's gcc at the start of a run, never committed as
binaries."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
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


# One busy loop pinned to a core, at nice 0: iterations a second it got (printed).
_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end = time.perf_counter() + float(sys.argv[2])
n = 0
while True:
    for _ in range(10_000):
        pass
    n += 1
    if time.perf_counter() >= end:
        break
print(n * 10_000 / float(sys.argv[2]))
"""


async def spin_capacity(seconds: float = 1.0) -> list[float]:
    """Loop iterations a second that a nice-0 busy loop pinned to each core gets, all
    cores at once. Compared with the same figure on the empty host, it is the share of
    each core still there for the platform and its sandboxes, whatever takes the rest:
    another process, or (on this fleet's VMs) time the vCPU spends outside the guest,
    which the guest's own counters charge to its pid 1 and its perf cannot sample."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SPIN, str(cpu), str(seconds), stdout=subprocess.PIPE
        )
        for cpu in sorted(os.sched_getaffinity(0))
    ]
    outs = await asyncio.gather(*(proc.communicate() for proc in procs))
    return [float(out.decode().strip() or 0) for out, _ in outs]


async def empty_host_spin() -> list[int]:
    """``spin_capacity`` on the host before the run adds anything: the best of three
    seconds per core (a shared host's noise only ever lowers it), the figure each
    step's ``spin_per_core`` reads against."""
    tries = [await spin_capacity(1.0) for _ in range(3)]
    return [round(max(core)) for core in zip(*tries, strict=True)]
