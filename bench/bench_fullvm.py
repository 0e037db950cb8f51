"""FullVM backend benchmark (issue 17), one run, accelerator named.

    .venv/bin/python bench/bench_fullvm.py [--boots 3] [--uefi-boots 1] [--shots 30]
        [--keys 10] [--execs 50] [--settle 5] [--restores 3]

Starts the platform in this process (dsec.roots.platform, as the conformance suite's
PlatformHarness does) with only the fullvm backend on a fresh data dir, imports the
project's small VM image (dsec.guest.vmimage: Debian's cloud kernel, busybox,
Debian's qemu-ga; direct kernel boot), then measures through the Edge (the calls the
API makes):

1. boot to agent-ready: create (QEMU start to a guest agent answering a sync), then
   stop, ``--boots`` times under SeaBIOS and ``--uefi-boots`` under OVMF;
2. exec round trip through the guest agent (``true``: guest-exec + status polls);
3. screenshot latency (QMP screendump to PNG, read back) on the VGA text console;
4. input-to-screen latency: one typed key (QMP input-send-event) until a screenshot
   differs from the one before (the guest's shell echoes it on tty1);
5. host memory per idle VM after ``--settle`` seconds: QEMU's RSS and PSS, the
   cgroup's usage, the overlay's allocated bytes;
6. snapshots (``--restores``): ``sb.snapshot`` of a running VM (frozen time and the
   whole call: state, flattened disk, into the store), then a start from that snapshot
   to an answering guest agent (restore, no boot), ``--restores`` times.

Everything is stopped and removed at the end, also on failure. Prints a summary,
writes bench/results/fullvm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conformance.conftest import import_test_vm  # noqa: E402
from tests.conftest import clean_leftovers, host_leaks  # noqa: E402

from bench.stats import summary  # noqa: E402
from dsec.api.desktop import ComputerAction  # noqa: E402
from dsec.api.exec import ExecRequest  # noqa: E402
from dsec.api.spec import BackendKind, DSecFullVMRunArgs  # noqa: E402
from dsec.backends.microvm.qemu import qemu_version  # noqa: E402
from dsec.config import PlatformConfig  # noqa: E402
from dsec.edge import desktop, vmsnapshot  # noqa: E402
from dsec.edge.edge import Edge  # noqa: E402
from dsec.roots.platform import running_platform  # noqa: E402

IMAGE = "fvm-bench:1"
VM_MB = 256
TIMEOUT = 300.0


def proc_kb(pid: int | None, name: str, file: str) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


async def boots(edge: Edge, n: int, firmware: str) -> dict[str, Any]:
    creates: list[float] = []
    stops: list[float] = []
    for _ in range(n):
        spec = DSecFullVMRunArgs.model_validate(
            {"vm_image": IMAGE, "memory_limit_mb": VM_MB, "firmware": firmware}
        )
        t0 = time.perf_counter()
        info = await edge.create(spec, timeout=TIMEOUT)
        creates.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await edge.stop(info.id)
        stops.append(time.perf_counter() - t0)
    return {"create_to_agent": summary(creates), "stop": summary(stops)}


async def kept_vm(edge: Edge, opts: argparse.Namespace) -> dict[str, Any]:
    info = await edge.create(
        DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=VM_MB), timeout=TIMEOUT
    )
    sid = info.id
    out: dict[str, Any] = {"accelerator": info.accelerator}
    try:
        samples = []
        for _ in range(opts.execs):
            t0 = time.perf_counter()
            res = await edge.exec(sid, ExecRequest(command=["true"]))
            samples.append(time.perf_counter() - t0)
            assert res.exit_code == 0
        out["exec_true"] = summary(samples)
        samples = []
        png = b""
        for _ in range(opts.shots):
            t0 = time.perf_counter()
            png = await desktop.screenshot(edge, sid)
            samples.append(time.perf_counter() - t0)
        out["screenshot"] = summary(samples)
        out["screenshot_bytes"] = len(png)
        samples = []
        for i in range(opts.keys):
            before = await desktop.screenshot(edge, sid)
            key = "abcdefghij"[i % 10]
            t0 = time.perf_counter()
            await desktop.computer_input(edge, sid, ComputerAction(action="write", text=key))
            while await desktop.screenshot(edge, sid) == before:
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError("a typed key never showed on the screen")
            samples.append(time.perf_counter() - t0)
        await desktop.computer_input(edge, sid, ComputerAction(action="press", keys=["ctrl", "u"]))
        out["key_to_screen"] = summary(samples)
        await asyncio.sleep(opts.settle)
        rec = edge.find(sid)
        assert rec is not None
        pid = rec.facts.init_pid
        stats = await edge.backend_of(rec).stats(rec)
        out["memory_idle"] = {
            "qemu_rss_mib": round((proc_kb(pid, "VmRSS", "status") or 0) / 2**20, 1),
            "qemu_pss_mib": round((proc_kb(pid, "Pss", "smaps_rollup") or 0) / 2**20, 1),
            "cgroup_mib": round((stats.get("memory_bytes") or 0) / 2**20, 1),
            "overlay_kib": round((stats.get("disk_bytes") or 0) / 1024, 1),
            "guest_ram_mib": VM_MB,
        }
    finally:
        await edge.stop(sid)
    return out


async def snapshots(edge: Edge, n: int) -> dict[str, Any]:
    info = await edge.create(
        DSecFullVMRunArgs(vm_image=IMAGE, memory_limit_mb=VM_MB), timeout=TIMEOUT
    )
    saves: list[float] = []
    starts: list[float] = []
    try:
        for i in range(n):
            ref = f"fvm-bench-snap:{i}-{secrets.token_hex(3)}"
            t0 = time.perf_counter()
            await vmsnapshot.snapshot(edge, info.id, ref)
            saves.append(time.perf_counter() - t0)
            spec = DSecFullVMRunArgs(vm_image=ref, memory_limit_mb=VM_MB)
            t0 = time.perf_counter()
            clone = await edge.create(spec, timeout=TIMEOUT)
            starts.append(time.perf_counter() - t0)
            await edge.stop(clone.id)
    finally:
        await edge.stop(info.id)
    return {"snapshot": summary(saves), "start_from_snapshot": summary(starts)}


async def run(opts: argparse.Namespace, config: PlatformConfig) -> dict[str, Any]:
    async with running_platform(config) as plat:
        t0 = time.perf_counter()
        await import_test_vm(plat.images, IMAGE)
        res: dict[str, Any] = {"import_s": round(time.perf_counter() - t0, 2)}
        res["bios"] = await boots(plat.edge, opts.boots, "bios")
        if opts.uefi_boots:
            res["uefi"] = await boots(plat.edge, opts.uefi_boots, "uefi")
        res["kept"] = await kept_vm(plat.edge, opts)
        if opts.restores:
            res["snapshots"] = await snapshots(plat.edge, opts.restores)
        res["backend_details"] = dict(plat.edge.backend_for(BackendKind.FULLVM).details())
    return res


def print_summary(res: dict[str, Any]) -> None:
    kept = res["kept"]
    details = res["backend_details"]
    accel = f"{details.get('accelerator')} ({details.get('accelerator_reason')})"
    print(f"fullvm benchmark: accelerator {accel}, {res['qemu']}")
    print(f"  image import (3 blobs, inspected): {res['import_s']} s")
    for fw in ("bios", "uefi"):
        if fw in res:
            c, s = res[fw]["create_to_agent"], res[fw]["stop"]
            print(
                f"  {fw}: create to agent p50 {c['p50_ms']:.0f} ms (n={c['n']}), "
                f"stop p50 {s['p50_ms']:.0f} ms"
            )
    for key in ("exec_true", "screenshot", "key_to_screen"):
        f = kept[key]
        print(f"  {key}: p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms (n={f['n']})")
    print(f"  screenshot size: {kept['screenshot_bytes']} bytes (720x400 text console)")
    print(f"  idle VM memory: {kept['memory_idle']}")
    for key, f in res.get("snapshots", {}).items():
        print(f"  {key}: p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms (n={f['n']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boots", type=int, default=3)
    ap.add_argument("--uefi-boots", type=int, default=1)
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--shots", type=int, default=30)
    ap.add_argument("--keys", type=int, default=10)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--settle", type=float, default=5.0)
    opts = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="dsec-fvb-", dir="/tmp"))  # short: socket paths
    config = PlatformConfig(
        data_dir=base / "d",
        edge_id="fvb" + secrets.token_hex(3),
        max_sandboxes=4,
        sandbox_disk_gb=2,
        stop_sandboxes_on_exit=True,
        backends=["fullvm"],
    )
    leaks: list[str] = []
    try:
        res = asyncio.run(run(opts, config))
    finally:
        with contextlib.suppress(Exception):
            leaks = host_leaks(config.data_dir, config.edge_id)
        with contextlib.suppress(Exception):
            clean_leftovers(config.data_dir, config.edge_id)
        shutil.rmtree(base, ignore_errors=True)
        if leaks:
            print(f"the platform left these behind (removed): {leaks}", file=sys.stderr)
    res["qemu"] = qemu_version()
    res["host"] = {"cpus": os.cpu_count(), "kernel": os.uname().release}
    res["leaks"] = leaks
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "fullvm.json").write_text(json.dumps(res, indent=2, default=str))
    print_summary(res)


if __name__ == "__main__":
    tempfile.tempdir = "/tmp"
    main()
