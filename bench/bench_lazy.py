"""Lazy vs eager layer loading (paper §5.3), at our scale, in one run.

An image of >= 1 GiB (busybox + 128 package directories of 64 files each) is published
to `dsec store serve` on loopback; a fresh platform per mode starts N sandboxes in one
burst, each reading its own ~8% of the image: a different random half of the files of
the job's working set (the packages tasks of this job touch, default 16% of the
image). Reported per mode: time until every sandbox finished, bytes the store sent,
bytes written to the host disk, time to first command; and the lazy time to first
command for a small and the big image (one sandbox, cold host).

    .venv/bin/python bench/bench_lazy.py [--sandboxes 64] [--gib 1.1] [--working-set 0.16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from dsec import DSecClient, DSecContainerRunArgs
from dsec.api.layers import ImageLoading
from dsec.images.builders import BUSYBOX_CONFIG, busybox_tree
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.publish import publish_tree
from dsec.net.ports import free_port

PACKAGES = 128
FILES_PER_PACKAGE = 64
TOKEN = "dst_bench_" + secrets.token_hex(8)


def make_tree(root: Path, total_bytes: int, seed: int) -> dict[str, int]:
    """busybox + PACKAGES x FILES_PER_PACKAGE files of 4 KiB-1 MiB; returns path -> size."""
    busybox_tree(root)
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0, 1.0) for _ in range(PACKAGES * FILES_PER_PACKAGE)]
    scale = total_bytes / sum(weights)
    files: dict[str, int] = {}
    i = 0
    for p in range(PACKAGES):
        pkg = root / "usr" / "lib" / f"pkg{p:03d}"
        pkg.mkdir(parents=True)
        for f in range(FILES_PER_PACKAGE):
            size = max(4096, min(1 << 20, int(weights[i] * scale)))
            i += 1
            (pkg / f"f{f:02d}.so").write_bytes(rng.randbytes(size))
            files[f"/usr/lib/pkg{p:03d}/f{f:02d}.so"] = size
    return files


def subsets(files: dict[str, int], n: int, working_set: float, seed: int) -> list[list[str]]:
    """Sandbox i reads a random half of the working set's files (its own seed)."""
    rng = random.Random(seed)
    packages = sorted({p.rsplit("/", 1)[0] for p in files})
    hot = set(rng.sample(packages, max(1, round(len(packages) * working_set))))
    pool = sorted(p for p in files if p.rsplit("/", 1)[0] in hot)
    out = []
    for i in range(n):
        r = random.Random(seed * 1000 + i)
        out.append(sorted(r.sample(pool, len(pool) // 2)))
    return out


def disk_sectors_written(path: Path) -> int:
    """Sectors written by the block device that holds ``path`` (sysfs, after sync)."""
    os.sync()
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    base = Path(f"/sys/dev/block/{major}:{minor}")
    stat = base / "stat"
    if not stat.exists():
        return 0
    if (base / "partition").exists():
        stat = base.resolve().parent / "stat"
    return int(stat.read_text().split()[6])


@contextlib.contextmanager
def store_server(root: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "dsec.cli.main", "store", "serve", "--root", str(root)]
    argv += ["--port", str(port), "--token", TOKEN]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def store_bytes(url: str) -> int:
    doc = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return int(doc["blob_bytes_sent"])


@contextlib.contextmanager
def platform(store_url: str, work: Path) -> Iterator[tuple[str, str, Path]]:
    data = Path(tempfile.mkdtemp(prefix="dsec-bl-", dir=work))
    port = free_port()
    key = "dsk_bench_" + secrets.token_hex(8)
    env = dict(os.environ, DSEC_LAYER_STORE=store_url, DSEC_LAYER_STORE_TOKEN=TOKEN)
    env["DSEC_EDGE_ID"] = "bl" + secrets.token_hex(3)
    env["XDG_CONFIG_HOME"] = str(data / "xdg")
    env["DSEC_STOP_SANDBOXES_ON_EXIT"] = "1"  # its terminate() cleans up, as before
    argv = [sys.executable, "-m", "dsec.cli.main", "up", "--port", str(port)]
    argv += ["--data-dir", str(data / "d"), "--api-key", key, "--no-save-config"]
    log = open(data / "up.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError((data / "up.log").read_text()[-3000:])
            time.sleep(0.1)
        yield url, key, data / "d"
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


async def burst(
    url: str, key: str, image: str, loading: ImageLoading, lists: list[list[str]]
) -> dict[str, float]:
    client = DSecClient(url, key, timeout=600)
    await client.open()
    first: list[float] = []
    done: list[float] = []
    t0 = time.perf_counter()

    async def one(files: list[str]) -> None:
        args = DSecContainerRunArgs(
            container_image=image,
            image_loading=loading,
            ttl_running_stop=3600,
        )
        sb = await client.run_container(args, timeout=600)
        r = await sb.run_shell("true")
        assert r.exit_code == 0
        first.append(time.perf_counter() - t0)
        r = await sb.run_shell("xargs cat > /dev/null", stdin="\n".join(files) + "\n", timeout=600)
        assert r.exit_code == 0, r.stderr[-500:]
        done.append(time.perf_counter() - t0)
        await sb.stop()

    try:
        await asyncio.gather(*(one(files) for files in lists))
        cache = await client.layer_cache()
    finally:
        await client.close()
    lazy = cache.get("lazy", {})
    return {
        "total_s": max(done),
        "first_command_first_s": min(first),
        "first_command_p50_s": statistics.median(first),
        "first_command_max_s": max(first),
        "lazy_fetch_bytes": float(lazy.get("fetch_bytes", 0)),
        "lazy_fetch_requests": float(lazy.get("fetch_requests", 0)),
        "lazy_fuse_read_requests": float(lazy.get("read_requests", 0)),
        "lazy_readahead_chunks": float(lazy.get("readahead_chunks", 0)),
        "lazy_readahead_chunks_used": float(lazy.get("readahead_chunks_used", 0)),
    }


async def single(url: str, key: str, image: str) -> float:
    client = DSecClient(url, key, timeout=600)
    await client.open()
    try:
        t0 = time.perf_counter()
        sb = await client.run_container(DSecContainerRunArgs(container_image=image))
        await sb.run_shell("true")
        elapsed = time.perf_counter() - t0
        await sb.stop()
        return elapsed
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=64)
    ap.add_argument("--gib", type=float, default=1.1)
    ap.add_argument("--working-set", type=float, default=0.16)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lazy.json")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-lazy-", dir="/var/tmp"))
    try:
        run(opts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def run(opts: argparse.Namespace, work: Path) -> None:
    load_start = loadavg()  # the host is shared: other work moves the times
    store_root = work / "store"
    store = DirStore(store_root)
    print(f"building a {opts.gib:g} GiB image and a 64 MiB one ...", flush=True)
    # The input trees live on tmpfs: deleting 8,000 files on the file system under test
    # would make ext4 skip those recently deleted inodes on every later inode allocation
    # (ext4's recently_deleted(), for 60 s), and the platform's per-sandbox mkdirs paid
    # for it (~10% of the CPU of a burst in a profile), in both modes.
    shm = Path("/dev/shm")
    trees = Path(tempfile.mkdtemp(prefix="dsec-bench-lazy-", dir=shm if shm.is_dir() else work))
    try:
        big_tree, small_tree = trees / "big", trees / "small"
        big_tree.mkdir()
        small_tree.mkdir()
        files = make_tree(big_tree, int(opts.gib * (1 << 30)), seed=1)
        make_tree(small_tree, 64 << 20, seed=2)
        config = dict(BUSYBOX_CONFIG)
        big = publish_tree(store, big_tree, "big", "1", kind="base", config=config)
        small = publish_tree(store, small_tree, "small", "1", kind="base", config=config)
    finally:
        shutil.rmtree(trees, ignore_errors=True)
    lists = subsets(files, opts.sandboxes, opts.working_set, seed=7)
    per_sandbox = statistics.mean(sum(files[p] for p in lst) for lst in lists)
    union = {p for lst in lists for p in lst}
    union_bytes = sum(files[p] for p in union)
    print(
        f"image {big.size_bytes / 2**20:.0f} MiB, {len(files)} files; each sandbox reads "
        f"{per_sandbox / big.size_bytes:.1%} ({per_sandbox / 2**20:.0f} MiB); union of all "
        f"reads {union_bytes / 2**20:.0f} MiB ({union_bytes / big.size_bytes:.1%})",
        flush=True,
    )
    results: dict[str, object] = {
        "image_bytes": big.size_bytes,
        "files": len(files),
        "sandboxes": opts.sandboxes,
        "per_sandbox_read_bytes": per_sandbox,
        "union_read_bytes": union_bytes,
        "index_bytes": 32 * (big.size_bytes // 65536 + 1) + 64,
        "small_image_bytes": small.size_bytes,
    }
    with store_server(store_root) as url:
        modes: tuple[ImageLoading, ...] = ("eager", "lazy")
        for loading in modes:
            with platform(url, work) as (purl, key, data):
                sent0, disk0 = store_bytes(url), disk_sectors_written(data)
                res = asyncio.run(burst(purl, key, "big:1", loading, lists))
                res["store_bytes_sent"] = store_bytes(url) - sent0
                res["disk_bytes_written"] = (disk_sectors_written(data) - disk0) * 512.0
            results[loading] = res
            print(f"{loading}: {json.dumps(res)}", flush=True)
        ttfc = {}
        for name in ("small:1", "big:1"):
            with platform(url, work) as (purl, key, _data):
                ttfc[name] = asyncio.run(single(purl, key, name))
        results["lazy_first_command_cold_s"] = ttfc
        print(f"lazy time to first command, one sandbox on a cold host: {ttfc}", flush=True)
    eager, lazy = results["eager"], results["lazy"]
    assert isinstance(eager, dict) and isinstance(lazy, dict)
    index_bytes = int(str(results["index_bytes"]))
    fetched_ratio = float(lazy["store_bytes_sent"]) / (union_bytes + index_bytes)
    summary = {
        "lazy_fetched_over_read": round(fetched_ratio, 3),
        "lazy_over_eager_total_time": round(lazy["total_s"] / eager["total_s"], 3),
        "lazy_disk_writes_vs_eager": round(
            lazy["disk_bytes_written"] / max(1.0, eager["disk_bytes_written"]), 3
        ),
        "ttfc_small_vs_big_s": [round(v, 4) for v in ttfc.values()],
    }
    results["summary"] = summary
    results["host_loadavg"] = {"start": load_start, "end": loadavg()}
    print("summary:", json.dumps(summary), flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
