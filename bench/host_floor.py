"""What this host gives at N idle sandboxes' worth of kernel objects, with no platform at
all (issue 19): the floor bench/bench_density.py's figures are read against.

    .venv/bin/python bench/host_floor.py [--max 10000] [--step 1000] [--raw 30]

The platform runs only at the start, to build busybox and hand over its EROFS layer
(copied out); then it is stopped. ``bench/holder_probe.c`` then makes ``--step`` more
"holders" at a time: a sleeping process in network, pid, ipc, uts and mount namespaces
of its own, in memory, cpu and pids cgroups of its own with a default 64 MiB sandbox's
limits (the CPU quota too: the kernel checks each write of it against every task group
on the host), with proc, a /dev tmpfs and devpts mounted (4 superblocks with the ipc
namespace's mqueue; a sandbox has 5, its overlay root the fifth). At 0 and at every
step, with nothing else of ours running:

- host memory per holder, in bench_density's columns (``memory_row``: the drop of
  ``MemAvailable`` since the start over the count, named ``..._per_sandbox``, and its
  kernel parts), plus the memory cgroups' shrinker map (bench/shrinkers.py);
- bench_density's ``idle_cpu`` over 3 s: the host's pid 1's CPU in cores, and what a
  busy loop pinned to each core still gets (``spin_per_core``, against the empty
  host's ``spin_per_core_start``);
- raw ``crun run --detach`` of the busybox layer with its own overlay and a default
  sandbox's limits (dsec.crun_baseline, the create baseline of bench_density), ``--raw``
  times: p50 and p99.

The verdicts: raw crun's growth from the first step to the last (the issue's create
growth target is <= 1.3x from 1,000 to 10,000 sandboxes), the share of the cores left at
the last step, and the memory per holder there (the target is <= 1 MiB a sandbox). So a
figure the platform cannot reach on this host is shown as the host's, measured in the
same way. The holders die with the probe (it kills and reaps them at the end of its
input, and they get SIGKILL if it dies); their cgroups are removed. Writes
bench/results/host_floor.json. Needs root, gcc, crun.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.bench_density import idle_cpu, meminfo, memory_row  # noqa: E402
from bench.probes import empty_host_spin, static_binary  # noqa: E402
from bench.shrinkers import probe as shrinker_probe  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecClient, linux  # noqa: E402
from dsec.crun_baseline import RawCrun, blob_path  # noqa: E402
from dsec.resources import cgroups  # noqa: E402

RESULTS = REPO / "bench" / "results" / "host_floor.json"


async def busybox_layer(out: Path) -> Path:
    """busybox's EROFS layer, built by a platform of its own and copied to ``out``."""
    with platform_process() as plat:
        async with DSecClient(plat.url, plat.api_key, timeout=600) as client:
            await client.build_image("busybox")
            layers = (await client.get_image("busybox:latest")).layers
        if len(layers) != 1:
            raise SystemExit(f"busybox has {len(layers)} layers; the baseline needs one")
        shutil.copyfile(blob_path(plat.data_dir, layers[0]), out)
    return out


def cgroup_parents(name: str) -> list[Path]:
    """Where the holders' cgroups go: ``name`` under the memory, cpu and pids v1
    hierarchies, or under the unified one (a v2 host: those controllers enabled below)."""
    host = cgroups.detect()
    roots = [host.v1[c] for c in ("memory", "cpu", "pids") if c in host.v1]
    if not roots and host.v2 is not None:
        return [host.v2 / name]
    return [root / name for root in roots]


def reap_orphans(patience_s: float = 60.0) -> int:
    """Reap the holders a dead probe left to us: the run's other children (crun, busy
    loops) are all waited for by then, so any child still here is one. Until no child
    is left, or ``patience_s``."""
    reaped, end = 0, time.monotonic() + patience_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            reaped += 1
        else:
            time.sleep(0.01)
    return reaped


def rmdir_patiently(path: Path) -> None:
    """Remove an empty cgroup (it may stay busy a moment after its last task went)."""
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


class Holders:
    """The probe process and the holders it keeps (``add``); ``close`` ends them all."""

    def __init__(self, binary: Path, parents: list[Path]) -> None:
        self.parents: list[Path] = []
        self.count = 0
        try:
            for parent in parents:
                parent.mkdir()
                self.parents.append(parent)
                if parent.parent == cgroups.detect().v2:  # v2: the children get controllers
                    (parent / "cgroup.subtree_control").write_text("+memory +cpu +pids")
            # A holder outlives its probe only as a zombie (it gets SIGKILL when the
            # probe dies): as the probe's subreaper, this process is the one to reap it.
            linux.become_subreaper()
            self.proc = subprocess.Popen(
                [str(binary), *map(str, parents)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except BaseException:
            self._remove_cgroups()
            raise

    def add(self, k: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"add {k}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer.startswith("ok "):
            raise RuntimeError(f"holder_probe: {answer or 'ended'}")
        self.count = int(answer.split()[1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=1800)  # 10,000 network namespaces take minutes to go
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its holders get SIGKILL with it (PR_SET_PDEATHSIG)
            self.proc.wait()
        if self.proc.returncode != 0:  # killed or crashed: its holders are ours to reap
            reap_orphans()
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        for parent in self.parents:
            for child in parent.glob("h*"):  # left only by a probe that did not finish
                rmdir_patiently(child)
            rmdir_patiently(parent)


async def measure(raw: RawCrun, rounds: int, base: dict[str, int], count: int) -> dict[str, Any]:
    row: dict[str, Any] = {"holders": count}
    if count:  # a holder stands in for a sandbox: bench_density's memory columns
        row.update(memory_row(base, count))
    row["shrinker_map_kib_per_memcg"] = shrinker_probe(probes=20, rounds=3)["map_kib_per_memcg"]
    row["idle_cpu"] = await idle_cpu(None)
    row["raw_crun"] = summary(raw.measure_detached(rounds))
    return row


async def run(opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    blob = await busybox_layer(work / "busybox.erofs")
    binary = work / "holder_probe"
    binary.write_bytes(static_binary("holder_probe.c", work))
    binary.chmod(0o755)
    res: dict[str, Any] = {"max": opts.max, "step": opts.step, "raw_rounds": opts.raw}
    res["spin_per_core_start"] = await empty_host_spin()
    rows: list[dict[str, Any]] = []
    with RawCrun(blob) as raw:
        raw.measure_detached(3)  # warm the layer and crun's own files
        base = meminfo()
        holders = Holders(binary, cgroup_parents(f"dsec-host-floor-{secrets.token_hex(4)}"))
        try:
            rows.append(await measure(raw, opts.raw, base, 0))
            print(json.dumps(rows[-1]), flush=True)
            while holders.count < opts.max:
                t = time.perf_counter()
                holders.add(min(opts.step, opts.max - holders.count))
                made_s = time.perf_counter() - t
                rows.append(await measure(raw, opts.raw, base, holders.count))
                rows[-1]["made_in_s"] = round(made_s, 1)
                print(json.dumps(rows[-1]), flush=True)
        finally:
            t = time.perf_counter()
            holders.close()
            res["removed_in_s"] = round(time.perf_counter() - t, 1)
    res["steps"] = rows
    res["verdicts"] = verdicts(res)
    return res


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in res["steps"] if r["holders"]]
    if not rows:
        return {}
    first, last = rows[0], rows[-1]
    start = res["spin_per_core_start"]
    return {
        "raw_crun_growth": round(last["raw_crun"]["p50_ms"] / first["raw_crun"]["p50_ms"], 2),
        "raw_crun_growth_from_holders": first["holders"],
        "raw_crun_p50_ms_empty": res["steps"][0]["raw_crun"]["p50_ms"],
        "cpu_left_at_last_step": round(
            sum(last["idle_cpu"]["spin_per_core"]) / max(1, sum(start)), 2
        ),
        "pid1_cores_at_last_step": last["idle_cpu"]["pid1_cores"],
        "host_mib_per_holder_at_last_step": last["host_mib_per_sandbox"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--max", type=int, default=10000)
    ap.add_argument("--step", type=int, default=1000)
    ap.add_argument("--raw", type=int, default=30, help="raw crun runs at each step")
    opts = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (namespaces, cgroups, mounts)")
    work = Path(tempfile.mkdtemp(prefix="dsec-host-floor-", dir="/tmp"))
    try:
        res = asyncio.run(run(opts, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["verdicts"], indent=2))


if __name__ == "__main__":
    main()
