"""The pause run of issue 19: sandboxes holding anonymous memory paused and resumed
with the platform's default swap, with and without resume prefetch, in one run.

    .venv/bin/python bench/bench_pause.py [--n 100] [--mib 256] [--swap-gb N]

On a real platform (`dsec up` in a subprocess, fresh data dir, *no swap setting*: the
platform's own swap file, dsec.resources.swap) ``n`` sandboxes of one job each run a
busybox awk that holds ``mib`` MiB of heap (anonymous memory, 4 KiB pages) and, on
each line written to a fifo, scans all of it (``index()`` over the string: every page
touched). Per mode:

* pause_job: its duration, per-sandbox pause (freeze + reclaim) p50/p99, memory the
  sandboxes' cgroups gave back (sum of ``memory.usage_in_bytes`` before and after) and
  what the host saw (MemAvailable delta, noisy on a shared host);
* resume_job: its duration (with prefetch: until the reads are queued) and the bytes
  prefetched; then the first command in every sandbox at once (``true``: the agent's
  and the shell's pages) p50/p99;
* a second pause and resume, then the first command that touches the held memory (the
  scan), at once in every sandbox, p50/p99, against the same scan with the memory
  resident before any pause (the baseline, measured in the same run).

Modes: ``prefetch`` (the default, DSEC_RESUME_PREFETCH=1) and ``no-prefetch``; one
platform per mode, one after the other. Writes bench/results/pause.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs, Sandbox  # noqa: E402
from dsec.resources import cgroups  # noqa: E402
from dsec.resources import swap as swapmod  # noqa: E402
from dsec.resources.capacity import mem_available  # noqa: E402

MiB = 1 << 20


def hold_script(mib: int) -> str:
    """A background awk holding ``mib`` MiB that scans it for each line on fifo p and
    answers on fifo q (so a waiting command sleeps, it does not spin)."""
    return (
        "mkfifo /tmp/p /tmp/q && "
        f'(awk \'BEGIN{{s=sprintf("%{mib * MiB}s","x")}} '
        '{print index(s,"y") > "/tmp/q"; close("/tmp/q")}\' </tmp/p >/dev/null 2>&1 &) && '
        "(sleep 1000000 >/tmp/p &) && echo x >/tmp/p && read l </tmp/q"
    )


# One scan of the held memory, waited for.
TOUCH = "echo x >/tmp/p && read l </tmp/q"


def usage(edge: str, sid: str) -> int:
    path = cgroups.detect().v1["memory"] / "dsec" / edge / sid / "memory.usage_in_bytes"
    try:
        return int(path.read_text())
    except OSError:
        return 0


async def timed(sb: Sandbox, cmd: str) -> float:
    t = time.perf_counter()
    r = await sb.run_shell(cmd, timeout=300)
    if r.exit_code != 0:
        raise RuntimeError(f"{cmd!r}: {r.stderr}")
    return time.perf_counter() - t


async def run_mode(mode: str, n: int, mib: int, swap_gb: int) -> dict[str, object]:
    env = {"DSEC_SWAP_GB": str(swap_gb), "DSEC_RESUME_PREFETCH": "1" if mode == "prefetch" else "0"}
    out: dict[str, object] = {"mode": mode}
    with platform_process(**env) as plat:
        areas = [
            s for s in swapmod.active_swaps() if swapmod.area_file(s).startswith(str(plat.data_dir))
        ]
        out["swap"] = [
            {"device": a.filename, "gib": round(a.size_bytes / (1 << 30), 2)} for a in areas
        ]
        client = DSecClient(plat.url, plat.api_key)
        await client.open()
        try:
            await client.build_image("busybox")
            job = f"pause-{mode}"
            spec = DSecContainerRunArgs(
                container_image="busybox:latest", memory_limit_mb=2 * mib + 64, job_id=job
            )
            sem = asyncio.Semaphore(8)

            async def make() -> Sandbox:
                async with sem:
                    sb = await client.run_container(spec)
                    await sb.run_shell(hold_script(mib), timeout=300)
                    return sb

            sbs = await asyncio.gather(*(make() for _ in range(n)))
            edge = plat.edge_id
            # baseline: the scan with the memory resident
            resident = [await timed(sb, TOUCH) for sb in sbs[: min(n, 10)]]
            out["touch_resident"] = summary(resident)

            for rnd, first in (("true", "true"), ("touch", TOUCH)):
                held = sum(usage(edge, sb.id) for sb in sbs)
                avail0 = mem_available()
                rep = await client.pause_job(job)
                await asyncio.sleep(0.5)  # the loop device's last writes
                after = sum(usage(edge, sb.id) for sb in sbs)
                avail1 = mem_available()
                t0 = time.perf_counter()
                res = await client.resume_job(job)
                resume_s = time.perf_counter() - t0
                lat = await asyncio.gather(*(timed(sb, first) for sb in sbs))
                out[f"round_{rnd}"] = {
                    "resume_plus_first_p50_s": round(resume_s + sorted(lat)[len(lat) // 2], 3),
                    "prefetch_pending": res.prefetch_pending,
                    "paused": rep.paused,
                    "failed": rep.failed,
                    "swap_available": rep.swap_available,
                    "pause_total_s": round(rep.duration, 3),
                    "pause_per_sandbox": summary([p.duration for p in rep.sandboxes]),
                    "cgroups_held_mib": held // MiB,
                    "cgroups_after_pause_mib": after // MiB,
                    "freed_fraction": round(1 - after / held, 4) if held else None,
                    "host_memavailable_delta_mib": (avail1 - avail0) // MiB,
                    "resume_total_s": round(resume_s, 3),
                    "prefetched_mib": res.prefetched_bytes // MiB,
                    f"first_command_{rnd}": summary(list(lat)),
                }
                print(mode, rnd, json.dumps(out[f"round_{rnd}"]), flush=True)
                # every round starts with the memory resident again
                await asyncio.gather(*(timed(sb, TOUCH) for sb in sbs))
            for sb in sbs:
                await sb.stop()
        finally:
            await client.close()
    return out


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--swap-gb", type=int, default=0, help="0: n*mib plus a quarter")
    args = ap.parse_args()
    swap_gb = args.swap_gb or max(1, -(-args.n * args.mib * 5 // 4 // 1024))
    results = {
        "n": args.n,
        "mib": args.mib,
        "loadavg_start": loadavg(),
        "modes": [
            await run_mode(m, args.n, args.mib, swap_gb) for m in ("prefetch", "no-prefetch")
        ],
        "loadavg_end": loadavg(),
    }
    dest = REPO / "bench" / "results" / "pause.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
