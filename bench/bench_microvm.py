"""MicroVM backend benchmark (issue 15), one run, side by side, accelerator named.

    .venv/bin/python bench/bench_microvm.py [--rounds 8] [--execs 200] [--hold-mb 256]
        [--pause-cycles 3] [--density 4] [--batch 16]

Starts the platform in this process (dsec.roots.platform, as the conformance suite's
PlatformHarness does) with the microvm and container backends on a fresh data dir,
builds busybox, then measures through the Edge (the same calls the API makes):

1. create to first command (create, then ``exec("true")``): microVM cold boot,
   microVM template restore, and a container (the baseline), interleaved rounds
   (the order rotates each round); each sandbox is stopped right after (stop timed);
2. exec round trip (``true``), a kept microVM vs a kept container, interleaved batches;
3. job pause (edge.pause_job) and resume (edge.resume_job, then the first command,
   which waits for the restore) of a VM holding ``--hold-mb`` MiB of non-zero data in
   its /dev/shm: cgroup usage, QEMU RSS and PSS before/after, the snapshot size, host
   MemAvailable; the data is checked (md5) after each resume. Baseline: a container
   holding 64 MiB (its /dev/shm size) paused the same way;
4. host memory per idle microVM: QEMU PSS (/proc/PID/smaps_rollup) plus the host page
   cache of its layer blobs (fincore), ``--density`` VMs on one shared image vs
   ``--density`` VMs each on its own copy of the layer (the busybox tree imported under
   N names with a marker file, so the blobs and their page cache differ), QEMU's RSS
   split into guest RAM, TCG's code buffer and QEMU's own; idle containers in the same
   step as the baseline;
5. how many idle microVMs fit: the per-VM figure against MemAvailable, checked with a
   real batch of ``--batch`` VMs (MemAvailable before/after), and the CPU idle VMs burn
   under the accelerator (QEMU utime+stime over a window), exec latency with the batch.

Cold boots are forced by turning the backend's template use off for that create only.
Everything is stopped and removed at the end, also on failure or Ctrl-C. Prints a
summary and writes bench/results/microvm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import clean_leftovers, host_leaks  # noqa: E402

from bench.stats import pct  # noqa: E402
from dsec.api.exec import ExecRequest  # noqa: E402
from dsec.api.spec import BackendKind, DSecContainerRunArgs, DSecMicroVMRunArgs  # noqa: E402
from dsec.backends.microvm.backend import VMM_OVERHEAD_MB, MicroVMBackend  # noqa: E402
from dsec.backends.microvm.qemu import qemu_version  # noqa: E402
from dsec.config import PlatformConfig  # noqa: E402
from dsec.edge.edge import Edge  # noqa: E402
from dsec.images import builders  # noqa: E402
from dsec.roots.platform import Platform, running_platform  # noqa: E402

MiB = 1 << 20
VM_MB = 256  # guest RAM of the create/exec/density VMs (the conformance suite's size)
TIMEOUT = 180.0
JOB_VM = "mvmbench-pause-vm"
JOB_CT = "mvmbench-pause-ct"


# -- figures ----------------------------------------------------------------------------
def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    if not ms:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    return {
        "n": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": pct(ms, 99),
        "mean_ms": statistics.fmean(ms),
    }


def meminfo() -> dict[str, int]:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, val = line.split(":", 1)
            info[key] = int(val.split()[0]) * 1024
    return info


def mem_available() -> int:
    return meminfo()["MemAvailable"]


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def proc_field(pid: int | None, name: str, file: str = "status") -> int | None:
    """A ``kB`` line of /proc/PID/status or smaps_rollup, in bytes."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss(pid: int | None) -> int | None:
    return proc_field(pid, "VmRSS")


def pss(pid: int | None) -> int | None:
    return proc_field(pid, "Pss", "smaps_rollup")


def rss_split(pid: int | None, guest_mb: int) -> dict[str, int]:
    """QEMU's resident memory by kind (/proc/PID/smaps): the guest's RAM (the anonymous
    mapping of exactly the guest's size), TCG's translated-code buffer (the anonymous
    rwx mapping), and the rest (QEMU's heap, libraries, device state)."""
    out = {"guest_ram": 0, "tcg_code": 0, "other": 0}
    if pid is None:
        return out
    kind = "other"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            anon = len(head) < 6
            if anon and head[1].startswith("rw-") and hi - lo == guest_mb * MiB:
                kind = "guest_ram"
            elif anon and head[1].startswith("rwx"):
                kind = "tcg_code"
            else:
                kind = "other"
        elif head and head[0] == "Rss:":
            out[kind] += int(head[1]) * 1024
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def cached_bytes(paths: list[Path]) -> int:
    """Host page cache held by ``paths`` (fincore)."""
    if not paths:
        return 0
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return sum(int(x) for x in out.split() if x.isdigit())


def drop_cache(paths: list[Path]) -> None:
    """Evict the (clean) page cache of ``paths``, so a step sees what its VMs read."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def other_qemus(ours: Path) -> int:
    """QEMU processes on this host that are not this run's (the host is shared)."""
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system-x86_64\0" in argv[:200] and str(ours).encode() not in argv:
            n += 1
    return n


def other_qemu_rss(ours: Path) -> int:
    """RSS of the QEMU processes on this host that are not this run's: another user of
    the host starting or stopping VMs moves MemAvailable by this much."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system-x86_64\0" in argv[:200] and str(ours).encode() not in argv:
            total += rss(int(entry)) or 0
    return total


def failed_vm_logs(b: Bench) -> dict[str, str]:
    """The end of qemu.log of every VM directory left (for a failed step's report)."""
    out = {}
    if b.vm.vms_dir.is_dir():
        for log_path in b.vm.vms_dir.glob("*/qemu.log"):
            with contextlib.suppress(OSError):
                out[log_path.parent.name] = log_path.read_text(errors="replace")[-600:]
    return out


def mib(n: float | None) -> float | None:
    return None if n is None else n / MiB


# -- the platform's parts this bench reads --------------------------------------------------
class Bench:
    def __init__(self, plat: Platform, base: Path) -> None:
        self.plat = plat
        self.edge: Edge = plat.edge
        self.base = base
        vm = self.edge.backend_for(BackendKind.MICROVM)
        assert isinstance(vm, MicroVMBackend)
        self.vm = vm
        self.live: set[str] = set()
        self.failures: list[str] = []  # creates that failed (and were retried)

    def vm_spec(self, **kw: Any) -> DSecMicroVMRunArgs:
        args: dict[str, Any] = {
            "image": "busybox:latest",
            "memory_limit_mb": VM_MB,
            "disk_limit_mb": 256,
            "cpu_cores_limit": 1.0,
            "ttl_running_stop": None,
        }
        args.update(kw)
        return DSecMicroVMRunArgs(**args)

    @staticmethod
    def ct_spec(**kw: Any) -> DSecContainerRunArgs:
        args: dict[str, Any] = {
            "container_image": "busybox:latest",
            "memory_limit_mb": VM_MB,
            "ttl_running_stop": None,
        }
        args.update(kw)
        return DSecContainerRunArgs(**args)

    async def create(self, spec: Any, *, template: bool = True, retry: bool = True) -> str:
        """Create; a failure is recorded in ``failures`` and, with ``retry``, the
        create is tried once more (a failure is a finding, not a reason to lose a run)."""
        t = time.perf_counter()
        try:
            return await self._create(spec, template=template)
        except Exception as exc:
            self.failures.append(
                f"{spec.backend} create ({'template' if template else 'cold'}) failed after "
                f"{time.perf_counter() - t:.1f} s: {type(exc).__name__}: {str(exc)[:300]}"
            )
            if not retry:
                raise
            return await self._create(spec, template=template)

    async def _create(self, spec: Any, *, template: bool) -> str:
        old = self.vm.templates
        self.vm.templates = template
        try:
            info = await self.edge.create(spec, timeout=TIMEOUT)
        finally:
            self.vm.templates = old
        self.live.add(info.id)
        return info.id

    async def sh(self, sid: str, cmd: str, *, timeout: float | None = None) -> str:
        res = await self.edge.exec(sid, ExecRequest(command=cmd, timeout=timeout))
        if res.exit_code != 0:
            raise RuntimeError(f"{cmd!r} in {sid} exited {res.exit_code}: {res.stderr[-400:]}")
        return res.stdout

    async def stop(self, sid: str) -> None:
        await self.edge.stop(sid)
        self.live.discard(sid)

    async def stop_all(self) -> None:
        for sid in list(self.live):
            with contextlib.suppress(Exception):
                await self.stop(sid)

    def qemu_pid(self, sid: str) -> int | None:
        rec = self.edge.find(sid)
        return None if rec is None else self.vm.facts(rec).pid

    def vm_cgroup_bytes(self, sid: str) -> int | None:
        return self.vm.cgroups.memory_usage(self.vm.cgroup_of(sid))

    def layer_blobs(self, sid: str) -> list[Path]:
        rec = self.edge.find(sid)
        assert rec is not None
        return [self.vm.layers.blob(d) for d in rec.image.layers]

    def templates(self) -> list[Path]:
        d = self.vm.templates_dir
        return sorted(d.glob("template-*.vmstate")) if d.is_dir() else []

    async def wait_template(self, count: int, timeout: float = 120) -> float:
        t = time.perf_counter()
        while len(self.templates()) < count:
            if time.perf_counter() - t > timeout:
                raise RuntimeError(f"no microVM template saved within {timeout}s")
            await asyncio.sleep(0.2)
        return time.perf_counter() - t


# -- 1. create to first command -------------------------------------------------------------
async def bench_create(b: Bench, rounds: int) -> dict[str, Any]:
    sides: dict[str, Callable[[], Awaitable[str]]] = {
        "microvm_cold": lambda: b.create(b.vm_spec(), template=False, retry=False),
        "microvm_template": lambda: b.create(b.vm_spec(), template=True, retry=False),
        "container": lambda: b.create(b.ct_spec(), retry=False),
    }
    failed: dict[str, list[str]] = {n: [] for n in sides}
    names = list(sides)
    out: dict[str, dict[str, list[float]]] = {
        n: {"create": [], "first_cmd": [], "total": [], "stop": []} for n in names
    }
    for r in range(rounds):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            t0 = time.perf_counter()
            try:
                sid = await sides[name]()
            except Exception as exc:
                failed[name].append(f"round {r + 1}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            t1 = time.perf_counter()
            await b.sh(sid, "true")
            t2 = time.perf_counter()
            await b.stop(sid)
            t3 = time.perf_counter()
            s = out[name]
            s["create"].append(t1 - t0)
            s["first_cmd"].append(t2 - t1)
            s["total"].append(t2 - t0)
            s["stop"].append(t3 - t2)
        print(f"  create round {r + 1}/{rounds} done", file=sys.stderr)
    res: dict[str, Any] = {n: {k: summary(v) for k, v in s.items()} for n, s in out.items()}
    for n in names:
        res[n]["failures"] = failed[n]
    ct = res["container"]["total"]["p50_ms"]
    res["ratio_p50_total_over_container"] = {
        n: res[n]["total"]["p50_ms"] / ct for n in ("microvm_cold", "microvm_template")
    }
    res["ratio_p50_cold_over_template"] = (
        res["microvm_cold"]["total"]["p50_ms"] / res["microvm_template"]["total"]["p50_ms"]
    )
    return res


# -- 2. exec round trip -------------------------------------------------------------------
async def exec_batch(b: Bench, sid: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await b.sh(sid, "true")
        out.append(time.perf_counter() - t)
    return out


async def bench_exec(b: Bench, execs: int) -> dict[str, Any]:
    kept = {"microvm": await b.create(b.vm_spec()), "container": await b.create(b.ct_spec())}
    try:
        for sid in kept.values():
            await exec_batch(b, sid, 20)  # warm the agent and the connection
        samples: dict[str, list[float]] = {k: [] for k in kept}
        per = 20
        for i in range(max(1, execs // per)):
            for side in list(kept) if i % 2 == 0 else list(reversed(kept)):
                samples[side] += await exec_batch(b, kept[side], per)
        res: dict[str, Any] = {k: summary(v) for k, v in samples.items()}
        res["ratio_p50_microvm_over_container"] = (
            res["microvm"]["p50_ms"] / res["container"]["p50_ms"]
        )
        return res
    finally:
        for sid in kept.values():
            await b.stop(sid)


# -- 3. pause and resume ---------------------------------------------------------------------
HOLD = (
    "set -e; dd if=/dev/urandom of=/tmp/seed bs=1M count=16 2>/dev/null; "
    "i=0; while [ $i -lt {chunks} ]; do cat /tmp/seed; i=$((i+1)); done > /dev/shm/hold; "
    "rm /tmp/seed; md5sum /dev/shm/hold"
)


async def bench_pause(b: Bench, hold_mb: int, cycles: int) -> dict[str, Any]:
    res: dict[str, Any] = {"hold_mib": hold_mb}
    # The VM: guest RAM large enough that /dev/shm (half of it) holds hold_mb MiB.
    vm_mb = max(512, hold_mb * 3)
    sid = await b.create(b.vm_spec(memory_limit_mb=vm_mb, job_id=JOB_VM), template=False)
    res["vm_memory_mb"] = vm_mb
    try:
        t = time.perf_counter()
        digest = (await b.sh(sid, HOLD.format(chunks=hold_mb // 16), timeout=300)).split()[0]
        res["vm_fill_s"] = time.perf_counter() - t
        cyc = []
        for c in range(cycles):
            await asyncio.sleep(1)
            pid = b.qemu_pid(sid)
            snap = b.vm.vm_dir(sid) / "state.snap"
            row: dict[str, Any] = {
                "cgroup_before": b.vm_cgroup_bytes(sid),
                "rss_before": rss(pid),
                "pss_before": pss(pid),
                "memavail_before": mem_available(),
            }
            t = time.perf_counter()
            rep = await b.edge.pause_job(JOB_VM)
            row["pause_s"] = time.perf_counter() - t
            if rep.paused != 1:
                raise RuntimeError(f"pause_job paused {rep.paused}: {rep.model_dump()}")
            sp = rep.sandboxes[0]
            row.update(
                freeze_s=sp.freeze_seconds,
                reclaim_s=sp.reclaim_seconds,
                report_reclaimed=rep.memory_reclaimed_bytes,
                cgroup_after=b.vm_cgroup_bytes(sid),
                qemu_alive_after=pid is not None and cpu_ticks(pid) > 0,
                rss_after=rss(pid) or 0,
                snapshot_bytes=snap.stat().st_size if snap.exists() else None,
                snapshot_cached_bytes=cached_bytes([snap]) if snap.exists() else None,
                memavail_after=mem_available(),
            )
            await asyncio.sleep(0.5)
            t = time.perf_counter()
            rr = await b.edge.resume_job(JOB_VM)
            row["resume_call_s"] = time.perf_counter() - t
            await b.sh(sid, "true")  # waits for the restore (requests queue in the socket)
            row["resume_to_first_cmd_s"] = time.perf_counter() - t
            if rr.resumed != 1:
                raise RuntimeError(f"resume_job resumed {rr.resumed}")
            npid = b.qemu_pid(sid)
            row.update(
                rss_resumed=rss(npid),
                pss_resumed=pss(npid),
                cgroup_resumed=b.vm_cgroup_bytes(sid),
                snapshot_left=snap.exists(),
            )
            t = time.perf_counter()
            again = (await b.sh(sid, "md5sum /dev/shm/hold", timeout=300)).split()[0]
            row["md5_s"] = time.perf_counter() - t
            row["data_intact"] = again == digest
            cyc.append(row)
            print(f"  pause cycle {c + 1}/{cycles} done", file=sys.stderr)
        res["vm_cycles"] = cyc
        res["vm"] = {
            "pause": summary([r["pause_s"] for r in cyc]),
            "reclaim": summary([r["reclaim_s"] for r in cyc]),
            "resume_call": summary([r["resume_call_s"] for r in cyc]),
            "resume_to_first_cmd": summary([r["resume_to_first_cmd_s"] for r in cyc]),
        }
    finally:
        await b.stop(sid)

    # Baseline: a container holding 64 MiB (its /dev/shm is 64 MiB), paused the same way.
    ct_hold = min(hold_mb, 48)
    sid = await b.create(b.ct_spec(job_id=JOB_CT))
    try:
        digest = (await b.sh(sid, HOLD.format(chunks=ct_hold // 16), timeout=300)).split()[0]
        cyc = []
        for _ in range(cycles):
            await asyncio.sleep(0.5)
            t = time.perf_counter()
            rep = await b.edge.pause_job(JOB_CT)
            row = {
                "pause_s": time.perf_counter() - t,
                "report_before": rep.memory_before_bytes,
                "report_reclaimed": rep.memory_reclaimed_bytes,
                "swap_available": rep.swap_available,
            }
            t = time.perf_counter()
            await b.edge.resume_job(JOB_CT)
            row["resume_call_s"] = time.perf_counter() - t
            await b.sh(sid, "true")
            row["resume_to_first_cmd_s"] = time.perf_counter() - t
            row["data_intact"] = (await b.sh(sid, "md5sum /dev/shm/hold")).split()[0] == digest
            cyc.append(row)
        res["container_hold_mib"] = ct_hold
        res["container_cycles"] = cyc
        res["container"] = {
            "pause": summary([r["pause_s"] for r in cyc]),
            "resume_to_first_cmd": summary([r["resume_to_first_cmd_s"] for r in cyc]),
        }
    finally:
        await b.stop(sid)
    return res


# -- 4. memory per idle microVM ----------------------------------------------------------------
async def copy_images(b: Bench, n: int) -> list[str]:
    """``n`` images of the busybox tree, each with its own marker file: same files,
    different EROFS blobs (so no page cache is shared between them)."""
    refs = []
    for i in range(n):
        tree = Path(tempfile.mkdtemp(prefix="mvb-tree-", dir=b.base))
        try:
            root = tree / "rootfs"
            root.mkdir()
            await asyncio.to_thread(builders.busybox_tree, root, b.plat.images.busybox)
            (root / "etc" / "dsec-bench-copy").write_text(f"{i} {secrets.token_hex(8)}\n")
            ref = f"mvmbench-copy{i}:latest"
            await b.plat.images.import_directory(ref, root)
            refs.append(ref)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    return refs


async def idle_vms(b: Bench, images: list[str], settle: float) -> dict[str, Any]:
    """Start one VM per entry of ``images`` (template restores), let them idle, and
    measure per VM: QEMU PSS and RSS, cgroup usage, the page cache of their layer
    blobs, host MemAvailable."""
    blobs: list[Path] = []
    for ref in set(images):
        info = await b.plat.images.resolve(ref)
        blobs += [b.plat.images.layer_path(d) for d in info.layers]
    await asyncio.to_thread(drop_cache, blobs)
    await asyncio.sleep(1)
    before = mem_available()
    others = other_qemu_rss(b.base)
    sids = []
    try:
        for ref in images:
            sids.append(await b.create(b.vm_spec(image=ref)))
        await asyncio.sleep(settle)
        for sid in sids:
            await b.sh(sid, "true")
        used = [b.layer_blobs(s) for s in sids]
        uniq = sorted({p for u in used for p in u})
        pids = [b.qemu_pid(s) for s in sids]
        pss_v = [pss(p) or 0 for p in pids]
        rss_v = [rss(p) or 0 for p in pids]
        cg = [b.vm_cgroup_bytes(s) or 0 for s in sids]
        split = [rss_split(p, VM_MB) for p in pids]
        cache = cached_bytes(uniq)
        after = mem_available() + (other_qemu_rss(b.base) - others)
        n = len(sids)
        return {
            "n": n,
            "distinct_blobs": len(uniq),
            "blob_bytes": sum(p.stat().st_size for p in uniq),
            "pss_per_vm_mib": statistics.fmean(pss_v) / MiB,
            "rss_per_vm_mib": statistics.fmean(rss_v) / MiB,
            "cgroup_per_vm_mib": statistics.fmean(cg) / MiB,
            "rss_split_per_vm_mib": {
                k: statistics.fmean(x[k] for x in split) / MiB for k in split[0]
            },
            "layer_cache_total_mib": cache / MiB,
            "layer_cache_per_vm_mib": cache / n / MiB,
            "per_vm_mib": (sum(pss_v) + cache) / n / MiB,
            "memavail_drop_per_vm_mib": (before - after) / n / MiB,
        }
    finally:
        for sid in sids:
            await b.stop(sid)


async def idle_containers(b: Bench, n: int, settle: float) -> dict[str, Any]:
    before = mem_available()
    sids = []
    try:
        for _ in range(n):
            sids.append(await b.create(b.ct_spec()))
        await asyncio.sleep(settle)
        after = mem_available()
        backend = b.edge.backend_for(BackendKind.CONTAINER)
        cg = []
        for sid in sids:
            rec = b.edge.find(sid)
            assert rec is not None
            cg.append((await backend.stats(rec)).get("memory_bytes") or 0)
        return {
            "n": n,
            "cgroup_per_sandbox_mib": statistics.fmean(cg) / MiB,
            "memavail_drop_per_sandbox_mib": (before - after) / n / MiB,
        }
    finally:
        for sid in sids:
            await b.stop(sid)


async def bench_density(b: Bench, n: int, settle: float) -> dict[str, Any]:
    copies = await copy_images(b, n)
    res: dict[str, Any] = {}
    res["shared"] = await idle_vms(b, ["busybox:latest"] * n, settle)
    res["own_copy"] = await idle_vms(b, copies, settle)
    res["container_baseline"] = await idle_containers(b, n, settle)
    for ref in copies:
        with contextlib.suppress(Exception):
            await b.plat.images.remove(ref)
    return res


# -- 5. how many fit ------------------------------------------------------------------------------
async def bench_batch(b: Bench, n: int, per_vm_mib: float, window: float) -> dict[str, Any]:
    total = meminfo()
    before = mem_available()
    others_before = other_qemu_rss(b.base)
    sids: list[str] = []
    res: dict[str, Any] = {"asked": n, "create_errors": []}
    create_s: list[float] = []
    try:
        t = time.perf_counter()
        for i in range(n):
            t1 = time.perf_counter()
            try:
                sids.append(await b.create(b.vm_spec(), retry=False))
                create_s.append(time.perf_counter() - t1)
            except Exception as exc:  # counted and reported: a failure is a finding here
                res["create_errors"].append(
                    f"VM {i + 1} after {time.perf_counter() - t1:.1f} s: {exc}"
                )
        res["create_all_s"] = time.perf_counter() - t
        res["create"] = summary(create_s)
        n = len(sids)
        res["n"] = n
        if n == 0:
            raise RuntimeError(f"no VM of the batch started: {res['create_errors'][:2]}")
        await asyncio.sleep(5)
        for sid in sids:
            await b.sh(sid, "true")
        await asyncio.sleep(2)
        after = mem_available()
        others_after = other_qemu_rss(b.base)
        pids = [p for p in (b.qemu_pid(s) for s in sids) if p is not None]
        pss_sum = sum(pss(p) or 0 for p in pids)
        cg_sum = sum(b.vm_cgroup_bytes(s) or 0 for s in sids)
        cache = cached_bytes(sorted({p for s in sids for p in b.layer_blobs(s)}))
        # CPU burnt by the idle VMs (guest timers under the accelerator)
        t0 = time.perf_counter()
        c0 = sum(cpu_ticks(p) for p in pids)
        await asyncio.sleep(window)
        c1 = sum(cpu_ticks(p) for p in pids)
        wall = time.perf_counter() - t0
        hz = os.sysconf("SC_CLK_TCK")
        cores = (c1 - c0) / hz / wall
        lat = await exec_batch(b, sids[0], 50)
        res.update(
            memavail_drop_raw_mib=(before - after) / MiB,
            other_qemu_rss_change_mib=(others_after - others_before) / MiB,
            # corrected for other users' VMs started or stopped meanwhile
            memavail_drop_mib=(before - after - (others_after - others_before)) / MiB,
            memavail_drop_per_vm_mib=(before - after - (others_after - others_before)) / n / MiB,
            predicted_drop_mib=per_vm_mib * n,
            pss_sum_mib=pss_sum / MiB,
            pss_cache_per_vm_mib=(pss_sum + cache) / n / MiB,
            cgroup_sum_mib=cg_sum / MiB,
            idle_cpu_cores_total=cores,
            idle_cpu_cores_per_vm=cores / n,
            exec_with_batch=summary(lat),
            memtotal_mib=total["MemTotal"] / MiB,
            memavail_before_mib=before / MiB,
        )
        per_vm_real = res["memavail_drop_per_vm_mib"]
        cpus = os.cpu_count() or 1
        res["fit_by_memory_extrapolated"] = int(before / MiB / per_vm_mib) if per_vm_mib else None
        res["fit_by_memory_batch"] = int(before / MiB / per_vm_real) if per_vm_real > 0 else None
        res["fit_by_cpu_idle"] = int(cpus / res["idle_cpu_cores_per_vm"]) if cores > 0 else None
        # What admission would let in at the VMs' limits (memory_limit + QEMU overhead).
        limit_mib = VM_MB + VMM_OVERHEAD_MB
        res["fit_by_limits_no_overcommit"] = int(total["MemTotal"] / MiB / limit_mib)
        return res
    finally:
        t = time.perf_counter()
        for sid in sids:
            await b.stop(sid)
        res["stop_all_s"] = time.perf_counter() - t


# -- driver ----------------------------------------------------------------------------------------
async def run(opts: argparse.Namespace, base: Path, config: PlatformConfig) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with running_platform(config) as plat:
        b = Bench(plat, base)
        try:
            await plat.images.build("busybox")
            t = time.perf_counter()
            await b.vm.guest_ready()  # the guest kernel, initramfs and the accelerator probe
            res["guest_ready_s"] = time.perf_counter() - t
            details = dict(b.vm.details())
            res["accelerator"] = details
            res["qemu"] = qemu_version()
            print_header(res, opts)
            # warm-up: page cache, layer mounts, and the template of the VM shape
            for _ in range(3):
                await b.stop(await b.create(b.ct_spec()))
            have = len(b.templates())
            t = time.perf_counter()
            sid = await b.create(b.vm_spec(), template=True)
            res["first_vm_create_s"] = time.perf_counter() - t
            res["guest_kernel"] = (await b.sh(sid, "uname -r")).strip()
            await b.stop(sid)
            if len(b.templates()) == have:
                res["template_wait_s"] = await b.wait_template(have + 1)
            await b.stop(await b.create(b.vm_spec()))  # first restore: template into cache

            steps: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]] = [
                ("create", lambda: bench_create(b, opts.rounds)),
                ("exec", lambda: bench_exec(b, opts.execs)),
                ("pause", lambda: bench_pause(b, opts.hold_mb, opts.pause_cycles)),
                ("density", lambda: bench_density(b, opts.density, opts.settle)),
                (
                    "batch",
                    lambda: bench_batch(
                        b,
                        opts.batch,
                        res.get("density", {}).get("shared", {}).get("per_vm_mib", 0.0),
                        opts.cpu_window,
                    ),
                ),
            ]
            for i, (name, step) in enumerate(steps):
                print(f"[{i + 1}/{len(steps)}] {name}", file=sys.stderr, flush=True)
                try:
                    res[name] = await step()
                except Exception as exc:  # one failed step does not lose the others
                    log_tail = failed_vm_logs(b)
                    res[name] = {"error": f"{type(exc).__name__}: {exc}", "qemu_logs": log_tail}
                    print(f"  {name} failed: {exc}", file=sys.stderr)
                    await b.stop_all()
        finally:
            res["create_failures"] = b.failures
            await b.stop_all()
    return res


def print_header(res: dict[str, Any], opts: argparse.Namespace) -> None:
    acc = res["accelerator"]
    mi = meminfo()
    print(f"microVM benchmark   accelerator: {acc.get('accelerator')}")
    print(f"  reason: {acc.get('accelerator_reason', acc.get('error', ''))[:300]}")
    print(
        f"  {res['qemu']}; host {os.cpu_count()} CPUs, MemTotal {mi['MemTotal'] / 2**30:.1f} GiB, "
        f"MemAvailable {mi['MemAvailable'] / 2**30:.1f} GiB, load {loadavg()}"
    )
    print(
        f"  rounds={opts.rounds} execs={opts.execs} hold={opts.hold_mb} MiB "
        f"pause_cycles={opts.pause_cycles} density={opts.density} batch={opts.batch}",
        flush=True,
    )


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_create(res: dict[str, Any]) -> None:
    c = res["create"]
    print(
        f"\n{'create to first command':40} {'n':>4} {'p50 ms':>10} {'p99 ms':>10}"
        f" {'create p50':>11} {'1st cmd p50':>12} {'stop p50':>9}"
    )
    labels = {
        "microvm_cold": "microVM cold boot",
        "microvm_template": "microVM template restore",
        "container": "container (baseline)",
    }
    for key, label in labels.items():
        s = c[key]
        print(
            f"{label:40} {s['total']['n']:>4} {s['total']['p50_ms']:>10.1f} "
            f"{s['total']['p99_ms']:>10.1f} {s['create']['p50_ms']:>11.1f} "
            f"{s['first_cmd']['p50_ms']:>12.1f} {s['stop']['p50_ms']:>9.1f}"
            + (f"  ({len(s['failures'])} creates FAILED)" if s["failures"] else "")
        )
        for f in s["failures"]:
            print(f"    failed: {f}")
    r = c["ratio_p50_total_over_container"]
    print(
        f"  ratios (p50): cold/container {r['microvm_cold']:.1f}x, template/container "
        f"{r['microvm_template']:.1f}x, cold/template {c['ratio_p50_cold_over_template']:.2f}x"
    )


def print_exec(res: dict[str, Any]) -> None:
    e = res["exec"]
    print(f"\n{'exec round trip (true)':40} {'n':>4} {'p50 ms':>10} {'p99 ms':>10}")
    for key, label in (("microvm", "microVM"), ("container", "container (baseline)")):
        print(f"{label:40} {e[key]['n']:>4} {e[key]['p50_ms']:>10.2f} {e[key]['p99_ms']:>10.2f}")
    print(f"  ratio (p50) microVM/container {e['ratio_p50_microvm_over_container']:.1f}x")


def print_pause(res: dict[str, Any]) -> None:
    p = res["pause"]
    print(
        f"\npause/resume, microVM ({p['vm_memory_mb']} MiB RAM) holding {p['hold_mib']} MiB "
        f"in /dev/shm (filled in {p['vm_fill_s']:.1f} s):"
    )
    print(
        f"  {'cycle':>5} {'pause s':>8} {'reclaim':>8} {'resume->cmd s':>13} {'cg before':>10}"
        f" {'cg after':>9} {'RSS bef':>8} {'PSS bef':>8} {'RSS aft':>8} {'snapshot':>9}"
        f" {'snap cached':>11} {'MemAvail +':>10} {'RSS resumed':>11} {'intact':>6}"
    )
    for i, row in enumerate(p["vm_cycles"]):
        print(
            f"  {i + 1:>5} {row['pause_s']:>8.2f} {row['reclaim_s']:>8.2f} "
            f"{row['resume_to_first_cmd_s']:>13.2f} {fmt(mib(row['cgroup_before'])):>10}"
            f" {fmt(mib(row['cgroup_after'])):>9} {fmt(mib(row['rss_before'])):>8}"
            f" {fmt(mib(row['pss_before'])):>8} {fmt(mib(row['rss_after'])):>8}"
            f" {fmt(mib(row['snapshot_bytes'])):>9} {fmt(mib(row['snapshot_cached_bytes'])):>11}"
            f" {fmt(mib(row['memavail_after'] - row['memavail_before'])):>10}"
            f" {fmt(mib(row['rss_resumed'])):>11} {row['data_intact']!s:>6}"
        )
    print("  (MiB; cg = the sandbox's cgroup usage; MemAvail + = host MemAvailable gained)")
    v, ct = p["vm"], p["container"]
    print(f"  {'':36} {'n':>4} {'p50 ms':>10} {'p99 ms':>10}")
    for label, s in (
        ("microVM pause_job", v["pause"]),
        ("microVM resume_job call", v["resume_call"]),
        ("microVM resume to first command", v["resume_to_first_cmd"]),
        (f"container pause_job ({p['container_hold_mib']} MiB held)", ct["pause"]),
        ("container resume to first command", ct["resume_to_first_cmd"]),
    ):
        print(f"  {label:36} {s['n']:>4} {s['p50_ms']:>10.1f} {s['p99_ms']:>10.1f}")
    cc = p["container_cycles"][0]
    print(
        f"  container pause reclaimed {fmt(mib(cc['report_reclaimed']))} of "
        f"{fmt(mib(cc['report_before']))} MiB (swap available: {cc['swap_available']})"
    )


def print_density(res: dict[str, Any]) -> None:
    d = res["density"]
    print(f"\nhost memory per idle microVM ({d['shared']['n']} VMs each, after settling):")
    print(
        f"  {'layers':28} {'blobs':>5} {'blob MiB':>8} {'PSS/VM':>7} {'RSS/VM':>7} {'cg/VM':>7}"
        f" {'cache tot':>9} {'cache/VM':>8} {'PSS+cache':>9} {'MemAvail-/VM':>12}"
    )
    for key, label in (("shared", "shared read-only (1 image)"), ("own_copy", "own copy each")):
        s = d[key]
        print(
            f"  {label:28} {s['distinct_blobs']:>5} {s['blob_bytes'] / MiB:>8.2f}"
            f" {s['pss_per_vm_mib']:>7.1f} {s['rss_per_vm_mib']:>7.1f}"
            f" {s['cgroup_per_vm_mib']:>7.1f}"
            f" {s['layer_cache_total_mib']:>9.2f} {s['layer_cache_per_vm_mib']:>8.2f}"
            f" {s['per_vm_mib']:>9.1f} {s['memavail_drop_per_vm_mib']:>12.1f}"
        )
    sp = d["shared"]["rss_split_per_vm_mib"]
    print(
        f"  QEMU RSS per VM by kind: guest RAM {sp['guest_ram']:.1f} MiB (of {VM_MB}), TCG "
        f"translated code {sp['tcg_code']:.1f} MiB, QEMU's own {sp['other']:.1f} MiB"
    )
    cb = d["container_baseline"]
    print(
        f"  container baseline ({cb['n']} idle): cgroup {cb['cgroup_per_sandbox_mib']:.2f} MiB, "
        f"MemAvailable drop {cb['memavail_drop_per_sandbox_mib']:.2f} MiB per container"
    )


def print_batch(res: dict[str, Any]) -> None:
    bt = res["batch"]
    shared_n = res.get("density", {}).get("shared", {}).get("n", "?")
    alone = res.get("exec", {}).get("microvm", {}).get("p50_ms", float("nan"))
    print(f"\nhow many idle microVMs fit ({VM_MB} MiB guests):")
    print(
        f"  batch of {bt['n']} (of {bt['asked']} asked): created in {bt['create_all_s']:.1f} s "
        f"(create p50 {bt['create']['p50_ms']:.0f} ms, p99 {bt['create']['p99_ms']:.0f} ms)"
    )
    for err in bt["create_errors"]:
        print(f"  create FAILED: {err[:400]}")
    print(
        f"  MemAvailable drop {bt['memavail_drop_mib']:.0f} MiB (raw "
        f"{bt['memavail_drop_raw_mib']:.0f}, other users' QEMU RSS changed by "
        f"{bt['other_qemu_rss_change_mib']:+.0f} MiB meanwhile), "
        f"{bt['memavail_drop_per_vm_mib']:.1f}/VM, vs predicted "
        f"{bt['predicted_drop_mib']:.0f} MiB from the {shared_n}-VM PSS+cache figure; "
        f"measured in the batch: PSS+cache {bt['pss_cache_per_vm_mib']:.1f} MiB/VM, cgroups "
        f"{bt['cgroup_sum_mib']:.0f} MiB in all; stop all {bt.get('stop_all_s', 0):.1f} s"
    )
    print(
        f"  idle CPU: {bt['idle_cpu_cores_total']:.3f} cores for {bt['n']} VMs "
        f"({bt['idle_cpu_cores_per_vm'] * 1000:.1f} millicores/VM); exec with the batch "
        f"p50 {bt['exec_with_batch']['p50_ms']:.1f} ms p99 {bt['exec_with_batch']['p99_ms']:.1f} ms"
        f" (vs {alone:.1f} ms alone)"
    )
    print(
        f"  fit by memory: {bt['fit_by_memory_extrapolated']} (extrapolated from PSS+cache) / "
        f"{bt['fit_by_memory_batch']} (from the batch's MemAvailable drop), MemAvailable "
        f"{bt['memavail_before_mib'] / 1024:.1f} GiB; fit by idle CPU: {bt['fit_by_cpu_idle']};"
        f" at the limits ({VM_MB}+{VMM_OVERHEAD_MB} MiB, no overcommit): "
        f"{bt['fit_by_limits_no_overcommit']}"
    )
    limits = {
        k: v
        for k, v in (
            ("memory", bt["fit_by_memory_batch"] or bt["fit_by_memory_extrapolated"]),
            ("idle CPU", bt["fit_by_cpu_idle"]),
        )
        if v is not None
    }
    if limits:
        first = min(limits, key=lambda k: limits[k])
        print(f"  the first limit to bite: {first} ({limits[first]} VMs)")


SECTIONS = {
    "create": print_create,
    "exec": print_exec,
    "pause": print_pause,
    "density": print_density,
    "batch": print_batch,
}


def print_summary(res: dict[str, Any]) -> None:
    acc = res.get("accelerator", {}).get("accelerator")
    print(f"\n== microVM ({acc}) vs container, busybox, {VM_MB} MiB, 1 vCPU ==")
    if "guest_ready_s" in res:
        print(
            f"guest kernel {res.get('guest_kernel')}; guest ready (kernel, initramfs, probe) "
            f"{res['guest_ready_s']:.2f} s; first VM create {res.get('first_vm_create_s', 0):.2f}"
            f" s; template saved {res.get('template_wait_s', 0):.1f} s after"
        )
    for name, show in SECTIONS.items():
        sec = res.get(name)
        if sec is None:
            print(f"\n[{name}] not run")
        elif "error" in sec:
            print(f"\n[{name}] FAILED: {sec['error']}")
        else:
            show(res)
    for err in res.get("create_failures", []):
        print(f"create failure (retried where a step needed the sandbox): {err}")
    print(
        f"\nload {res['host']['loadavg_start']} -> {res['host']['loadavg_end']}; "
        f"other QEMUs on the host at start: {res['host']['other_qemus_start']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--hold-mb", type=int, default=256)
    ap.add_argument("--pause-cycles", type=int, default=3)
    ap.add_argument("--density", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--settle", type=float, default=5.0, help="idle seconds before measuring")
    ap.add_argument("--cpu-window", type=float, default=10.0)
    opts = ap.parse_args()
    if opts.hold_mb % 16:
        ap.error("--hold-mb must be a multiple of 16")
    base = Path(tempfile.mkdtemp(prefix="dsec-mvb-", dir="/tmp"))  # short: socket paths
    config = PlatformConfig(
        data_dir=base / "d",
        edge_id="mvb" + secrets.token_hex(3),
        max_sandboxes=opts.batch + opts.density * 2 + 8,
        sandbox_disk_gb=8,
        stop_sandboxes_on_exit=True,
        backends=["microvm", "container"],
    )
    host = {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "loadavg_start": loadavg(),
        "other_qemus_start": other_qemus(base),
    }
    leaks: list[str] = []
    try:
        res = asyncio.run(run(opts, base, config))
    finally:
        with contextlib.suppress(Exception):
            leaks = host_leaks(config.data_dir, config.edge_id)
        with contextlib.suppress(Exception):
            clean_leftovers(config.data_dir, config.edge_id)
        shutil.rmtree(base, ignore_errors=True)
        if leaks:
            print(f"the platform left these behind (removed): {leaks}", file=sys.stderr)
    host["loadavg_end"] = loadavg()
    res["host"] = host
    res["leaks"] = leaks
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "microvm.json").write_text(json.dumps(res, indent=2, default=str))
    print_summary(res)


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
