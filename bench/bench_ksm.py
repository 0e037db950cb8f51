"""Does KSM pay for idle sandboxes? (issue 19, item 3) Memory merged vs ksmd's CPU.

    .venv/bin/python bench/bench_ksm.py [--n 40] [--settle 20] [--pages-to-scan 100]

KSM only looks at memory a process opted in: ``madvise(MADV_MERGEABLE)`` per range, or
``prctl(PR_SET_MEMORY_MERGE)`` (Linux 6.4+) for the whole process, kept across fork and
(since 6.7) exec. This bench starts ``--n`` idle processes of each kind below from a
parent that set ``PR_SET_MEMORY_MERGE`` (so every page of theirs is a candidate, the
most KSM could do for a sandbox whose every process opted in), turns ksmd on with the
given scan rate, waits for two full scans and then ``--settle`` seconds, and reports:

- the anonymous memory of the N processes before (``RssAnon``) and what KSM merged
  (``/proc/PID/ksm_merging_pages`` and ``ksm_process_profit``, summed over our own
  processes only: other work on the host with mergeable memory, e.g. QEMU guests,
  does not count);
- ksmd's CPU (``/proc/<ksmd>/stat``) while it converged and per second once settled
  (it keeps rescanning every candidate page for as long as they exist).

Kinds: ``busybox`` (an idle ``busybox sh``, what an idle busybox sandbox runs besides
its agent), ``python`` (an idle python3 with a few stdlib imports, like an idle Python
tool sandbox), ``same16m`` (python3 holding 16 MiB of content identical across the
processes: KSM's best case, e.g. the same dataset loaded by every rollout).

KSM's run state is host-wide: it is restored to what it was before, also on failure.
Writes bench/results/ksm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KSM = Path("/sys/kernel/mm/ksm")
PR_SET_MEMORY_MERGE = 67
PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20

PY = "/usr/bin/python3"
KINDS: dict[str, list[str]] = {
    "busybox": ["/usr/bin/busybox", "sh", "-c", "read x"],
    "python": [PY, "-c", "import json, re, asyncio, subprocess, sys; sys.stdin.read()"],
    "same16m": [
        PY,
        "-c",
        "import random, sys; random.seed(19); b = bytearray(random.randbytes(16 << 20));"
        " sys.stdin.read()",
    ],
}


def ksmd_cpu() -> float:
    """ksmd's CPU seconds so far (0 if the thread is not found)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "ksmd":
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def ksm_value(name: str) -> int:
    return int((KSM / name).read_text())


@contextlib.contextmanager
def ksm_running(pages_to_scan: int, sleep_ms: int) -> Iterator[None]:
    """ksmd on at the given rate; the host's previous settings back afterwards."""
    names = ("run", "pages_to_scan", "sleep_millisecs")
    saved = {n: (KSM / n).read_text().strip() for n in names}
    try:
        (KSM / "pages_to_scan").write_text(str(pages_to_scan))
        (KSM / "sleep_millisecs").write_text(str(sleep_ms))
        (KSM / "run").write_text("1")
        yield
    finally:
        for n in ("pages_to_scan", "sleep_millisecs", "run"):
            with contextlib.suppress(OSError):
                (KSM / n).write_text(saved[n])


def opt_in() -> None:
    """Runs in the child before exec: the whole process (and what it execs) mergeable."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MEMORY_MERGE)")


def proc_stat(pid: int) -> dict[str, int]:
    out = {"anon_kib": 0, "merging_pages": 0, "profit_bytes": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            out["anon_kib"] = int(line.split()[1])
    for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
        key, _, val = line.partition(" ")
        if key == "ksm_merging_pages":
            out["merging_pages"] = int(val)
        elif key == "ksm_process_profit":
            out["profit_bytes"] = int(val)
    return out


def totals(pids: list[int]) -> dict[str, float]:
    stats = [proc_stat(p) for p in pids]
    return {
        "anon_mib": round(sum(s["anon_kib"] for s in stats) / 1024, 2),
        "merged_mib": round(sum(s["merging_pages"] for s in stats) * PAGE / MiB, 2),
        "profit_mib": round(sum(s["profit_bytes"] for s in stats) / MiB, 2),
    }


def run_kind(kind: str, opts: argparse.Namespace) -> dict[str, Any]:
    procs = [
        subprocess.Popen(KINDS[kind], stdin=subprocess.PIPE, preexec_fn=opt_in)
        for _ in range(opts.n)
    ]
    try:
        time.sleep(2.0)  # imports done, memory touched
        pids = [p.pid for p in procs]
        before = totals(pids)
        with ksm_running(opts.pages_to_scan, opts.sleep_ms):
            scans0, cpu0, t0 = ksm_value("full_scans"), ksmd_cpu(), time.monotonic()
            while ksm_value("full_scans") < scans0 + 2 and time.monotonic() - t0 < opts.timeout:
                time.sleep(0.2)
            converge_s = time.monotonic() - t0
            converge_cpu = ksmd_cpu() - cpu0
            merged = totals(pids)
            cpu1, t1 = ksmd_cpu(), time.monotonic()
            time.sleep(opts.settle)
            steady = (ksmd_cpu() - cpu1) / (time.monotonic() - t1)
            after = totals(pids)
        return {
            "n": opts.n,
            "anon_mib_before": before["anon_mib"],
            "anon_mib_per_process": round(before["anon_mib"] / opts.n, 3),
            "merged_mib_after_2_scans": merged["merged_mib"],
            "merged_mib_settled": after["merged_mib"],
            "profit_mib_settled": after["profit_mib"],
            "saved_mib_per_process": round(after["profit_mib"] / opts.n, 3),
            "saved_share_of_anon": round(after["profit_mib"] / max(before["anon_mib"], 1e-9), 3),
            "two_scans_s": round(converge_s, 1),
            "ksmd_cpu_s_to_two_scans": round(converge_cpu, 2),
            "ksmd_cpu_share_settled": round(steady, 3),
        }
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--settle", type=float, default=20.0)
    ap.add_argument("--pages-to-scan", type=int, default=100)
    ap.add_argument("--sleep-ms", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    opts = ap.parse_args()
    if not (KSM / "run").exists():
        sys.exit("this kernel has no KSM (/sys/kernel/mm/ksm)")
    res: dict[str, Any] = {
        "pages_to_scan": opts.pages_to_scan,
        "sleep_millisecs": opts.sleep_ms,
        "kernel": os.uname().release,
    }
    for kind in opts.kinds.split(","):
        res[kind] = run_kind(kind, opts)
        print(kind, json.dumps(res[kind]), flush=True)
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "ksm.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
