"""Pulling from an OCI registry (issue 21): pull + first command, and what sharing saves.

A multi-layer image (busybox base + data layers, gzip and one zstd; --gib, default
0.25, ~1 GiB with --gib 1) and a second image sharing its base are built here and
pushed with skopeo to Debian's docker-registry on loopback. Interleaved rounds, each
on a fresh platform (cold host):

* ``skopeo``: ``skopeo copy`` of the image to an OCI directory: download alone, the floor;
* ``download-then-convert``: `dsec image pull` fetching each layer whole, then converting;
* ``streaming``: converting each layer while it downloads (the default);
* ``lazy``: a second host of a cluster whose layer store already holds the converted
  layers (the first host published them): it converts and downloads nothing but the
  manifest and config, and the first command loads chunks lazily from the store.

Each is followed by the first command in a sandbox of the image. Then the second image,
sharing the base, is pulled on the same host: bytes fetched and layers reused.

    .venv/bin/python bench/bench_pull.py [--gib 0.25] [--layers 4] [--rounds 3]

The Dockerfile build (cold and cached) part of issue 21 belongs to `dsec image build`
(another branch); its section goes in ``dockerfile_build`` below.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the tests' registry fixtures

from tests.conftest import PlatformProcess, platform_process  # noqa: E402
from tests.oci_registry import Layout, Registry, busybox_base, layer_tar, registry  # noqa: E402

from bench.bench_lazy import TOKEN, store_bytes, store_server  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecContainerRunArgs, DSecSyncClient  # noqa: E402
from dsec.api.layers import ImageLoading  # noqa: E402
from dsec.images.builders import busybox_tree  # noqa: E402

MODES = ("skopeo", "download-then-convert", "streaming", "lazy")


def data_layer(rng: random.Random, total: int, prefix: str) -> bytes:
    """``total`` bytes in 1-8 MiB files, half random and half text (gzip's usual ~2:1)."""
    entries: dict[str, bytes | str | None] = {}
    done, n = 0, 0
    while done < total:
        size = min(total - done, rng.randint(1, 8) << 20)
        half = size // 2
        text = (b"lorem ipsum dolor sit amet %d\n" % n) * (half // 28 + 1)
        entries[f"{prefix}/f{n:04d}.bin"] = rng.randbytes(half) + text[: size - half]
        done += size
        n += 1
    return layer_tar(entries)


def build(layout_dir: Path, gib: float, layers: int) -> int:
    """Image ``big`` (``layers`` layers) and ``second`` (its base + one small layer);
    returns the uncompressed size of ``big``."""
    rng = random.Random(21)
    total = int(gib * (1 << 30))
    per = total // layers
    layout = Layout(layout_dir)
    base = busybox_base({}) if per == 0 else _base(rng, per)
    tars = [(base, "gzip")]
    for i in range(1, layers):
        tars.append((data_layer(rng, per, f"data/l{i}"), "zstd" if i == layers - 1 else "gzip"))
    config: dict[str, object] = {"Env": ["PATH=/bin:/sbin"], "Cmd": ["sh"]}
    layout.tag("big", [layout.image(tars, config)])
    small = layer_tar({"second.txt": b"second image\n"})
    layout.tag("second", [layout.image([(base, "gzip"), (small, "gzip")], config)])
    return sum(len(t) for t, _ in tars)


def _base(rng: random.Random, size: int) -> bytes:
    """busybox plus ``size`` bytes of data, one layer."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        data = data_layer(rng, size, "usr/share/base")
        (tree / "data.tar").write_bytes(data)
        subprocess.run(["tar", "-C", str(tree), "-xf", str(tree / "data.tar")], check=True)
        (tree / "data.tar").unlink()
        busybox_tree(tree)
        return layer_tar({}, base=tree)


def first_command(client: DSecSyncClient, image: str, loading: ImageLoading = "eager") -> float:
    t0 = time.perf_counter()
    sb = client.run_container(
        DSecContainerRunArgs(container_image=image, memory_limit_mb=256, image_loading=loading),
        timeout=600,
    )
    try:
        r = sb.run_shell("cat /data/l1/f0000.bin | wc -c")
        assert r.exit_code == 0, r.stderr
    finally:
        sb.stop()
    return time.perf_counter() - t0


def skopeo_round(reg: Registry, work: Path) -> dict[str, Any]:
    dest = work / "skopeo-copy"
    t0 = time.perf_counter()
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--src-tls-verify=false",
         f"docker://{reg.host}/bench/big:v1", f"oci:{dest}:big"],
        check=True, capture_output=True, timeout=3600,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    fetched = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    shutil.rmtree(dest)
    return {"pull_s": seconds, "first_cmd_s": 0.0, "bytes_fetched": fetched}


def pull_round(plat: PlatformProcess, ref: str, streaming: bool) -> dict[str, Any]:
    with DSecSyncClient(plat.url, plat.api_key, timeout=3600) as client:
        t0 = time.perf_counter()
        res = client.pull_image(ref, streaming=streaming, timeout=3600)
        pull_s = time.perf_counter() - t0
        cmd_s = first_command(client, ref)
    return {
        "pull_s": pull_s,
        "first_cmd_s": cmd_s,
        "bytes_fetched": res.bytes_fetched,
        "convert_s": sum(layer.convert_seconds for layer in res.layers),
        "uncompressed_bytes": sum(layer.uncompressed_bytes for layer in res.layers),
        "erofs_bytes": sum(layer.erofs_bytes for layer in res.layers),
        "layers_converted": sum(not layer.reused for layer in res.layers),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gib", type=float, default=0.25, help="size of the big image")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-pull-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        size = build(work / "layout", opts.gib, opts.layers)
        print(f"built the images ({size / (1 << 20):.0f} MiB) in {time.perf_counter() - t0:.0f}s")
        with registry() as reg, store_server(work / "store") as store_url:
            reg.push(work / "layout", "big", "bench/big:v1")
            reg.push(work / "layout", "second", "bench/second:v1")
            report = run(opts, work, reg, store_url)
        report["image_bytes_uncompressed"] = size
        report["dockerfile_build"] = None  # filled by `dsec image build` (branch ocibuild)
        print(json.dumps(report, indent=2))


def run(opts: argparse.Namespace, work: Path, reg: Registry, store_url: str) -> dict[str, Any]:
    big = f"{reg.host}/bench/big:v1"
    env = {"DSEC_INSECURE_REGISTRIES": reg.host}
    shared = {**env, "DSEC_LAYER_STORE": store_url, "DSEC_LAYER_STORE_TOKEN": TOKEN}
    # The first host of the cluster converts and publishes (not timed).
    with platform_process(**shared) as plat, DSecSyncClient(plat.url, plat.api_key) as c:
        c.pull_image(big, timeout=3600)
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    rounds: dict[str, Callable[[], dict[str, Any]]] = {
        "skopeo": lambda: skopeo_round(reg, work),
        "download-then-convert": lambda: _fresh(env, big, streaming=False),
        "streaming": lambda: _fresh(env, big, streaming=True),
        "lazy": lambda: _lazy(shared, big, store_url),
    }
    for r in range(opts.rounds):
        for mode in MODES:
            samples[mode].append(rounds[mode]())
            print(f"round {r + 1} {mode}: {json.dumps(samples[mode][-1])}", flush=True)
    out: dict[str, Any] = {}
    for mode, rows in samples.items():
        out[mode] = {
            "pull": summary([row["pull_s"] for row in rows]),
            "first_command": summary([row["first_cmd_s"] for row in rows]),
            "pull_and_first_command": summary([row["pull_s"] + row["first_cmd_s"] for row in rows]),
            "bytes_fetched": rows[-1]["bytes_fetched"],
            **{k: v for k, v in rows[-1].items() if k not in ("pull_s", "first_cmd_s")},
        }
    with platform_process(**env) as plat, DSecSyncClient(plat.url, plat.api_key) as c:
        c.pull_image(big, timeout=3600)
        t0 = time.perf_counter()
        res = c.pull_image(f"{reg.host}/bench/second:v1", timeout=3600)
        out["second_image_sharing_base"] = {
            "pull_s": time.perf_counter() - t0,
            "bytes_fetched": res.bytes_fetched,
            "layers": len(res.layers),
            "layers_reused": sum(layer.reused for layer in res.layers),
            "bytes_reused_erofs": sum(lay.erofs_bytes for lay in res.layers if lay.reused),
        }
    return out


def _fresh(env: dict[str, str], ref: str, *, streaming: bool) -> dict[str, Any]:
    with platform_process(**env) as plat:
        return pull_round(plat, ref, streaming)


def _lazy(env: dict[str, str], ref: str, store_url: str) -> dict[str, Any]:
    with platform_process(**env) as plat, DSecSyncClient(plat.url, plat.api_key) as client:
        sent = store_bytes(store_url)
        t0 = time.perf_counter()
        res = client.pull_image(ref, timeout=3600)
        pull_s = time.perf_counter() - t0
        cmd_s = first_command(client, ref, loading="lazy")
        return {
            "pull_s": pull_s,
            "first_cmd_s": cmd_s,
            "bytes_fetched": res.bytes_fetched,
            "store_bytes_sent": store_bytes(store_url) - sent,
            "layers_converted": sum(not layer.reused for layer in res.layers),
        }


if __name__ == "__main__":
    main()
