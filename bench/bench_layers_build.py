"""Monolithic images vs composable layers: how many builds, how long (paper §5.1).

M base images x N workspaces. Monolithic: one flattened EROFS image per (base,
workspace) pair, so building everything is M*N builds, and updating one package of a
base rebuilds the N images on top of it. Composable: M base layers + N workspace
layers, stacked by overlayfs at sandbox start, and a package update rebuilds one layer.
Every build is a real mkfs.erofs into a real content-addressed store.

    .venv/bin/python bench/bench_layers_build.py [--bases 3] [--workspaces 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dsec.images.builders import busybox_tree
from dsec.images.store import LayerStore


def make_base(root: Path, i: int, version: int, mib: int) -> None:
    busybox_tree(root)
    rng = random.Random(i * 100 + version)
    for p in range(8):
        pkg = root / "usr" / "lib" / f"pkg{p}"
        pkg.mkdir(parents=True, exist_ok=True)
        size = mib * (1 << 20) // 8
        (pkg / "lib.so").write_bytes(rng.randbytes(size))
    (root / "etc" / "base-version").write_text(f"{i}.{version}\n")


def make_workspace(root: Path, j: int, mib: int) -> None:
    rng = random.Random(10_000 + j)
    ws = root / "workspace" / "src"
    ws.mkdir(parents=True)
    for f in range(64):
        (ws / f"m{f}.py").write_bytes(rng.randbytes(mib * (1 << 20) // 64))


def merge(base: Path, ws: Path, dest: Path) -> None:
    subprocess.run(["cp", "-a", f"{base}/.", str(dest)], check=True)
    subprocess.run(["cp", "-a", f"{ws}/.", str(dest)], check=True)


async def build(store: LayerStore, tree: Path) -> float:
    t = time.perf_counter()
    await store.build_erofs(tree)
    return time.perf_counter() - t


async def scenario(m: int, n: int, base_mib: int, ws_mib: int, work: Path) -> dict[str, object]:
    src = work / "src"
    bases = [src / f"base{i}" for i in range(m)]
    wss = [src / f"ws{j}" for j in range(n)]
    for i, b in enumerate(bases):
        b.mkdir(parents=True)
        make_base(b, i, 1, base_mib)
    for j, w in enumerate(wss):
        w.mkdir(parents=True)
        make_workspace(w, j, ws_mib)
    store = LayerStore(work / "store")
    store.open()

    async def monolithic(which_bases: list[int]) -> tuple[int, float]:
        count, spent = 0, 0.0
        for i in which_bases:
            for w in wss:
                flat = work / "flat"
                flat.mkdir()
                t = time.perf_counter()
                merge(bases[i], w, flat)  # assembling the image is part of its build
                spent += time.perf_counter() - t
                spent += await build(store, flat)
                count += 1
                shutil.rmtree(flat)
        return count, spent

    async def composable(trees: list[Path]) -> tuple[int, float]:
        spent = 0.0
        for tree in trees:
            spent += await build(store, tree)
        return len(trees), spent

    out: dict[str, object] = {"bases": m, "workspaces": n, "base_mib": base_mib, "ws_mib": ws_mib}
    out["initial_monolithic"] = await monolithic(list(range(m)))
    out["initial_composable"] = await composable(bases + wss)
    # One package of base 0 gets a security update.
    shutil.rmtree(bases[0])
    bases[0].mkdir()
    make_base(bases[0], 0, 2, base_mib)
    out["update_monolithic"] = await monolithic([0])
    out["update_composable"] = await composable([bases[0]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bases", type=int, default=3)
    ap.add_argument("--workspaces", type=int, default=16)
    ap.add_argument("--base-mib", type=int, default=48)
    ap.add_argument("--ws-mib", type=int, default=4)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "layers_build.json"
    )
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-build-", dir="/var/tmp"))
    try:
        res = asyncio.run(scenario(opts.bases, opts.workspaces, opts.base_mib, opts.ws_mib, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{opts.bases} bases x {opts.workspaces} workspaces")
    print(f"{'':28}{'builds':>8}{'seconds':>10}")
    for key in (
        "initial_monolithic",
        "initial_composable",
        "update_monolithic",
        "update_composable",
    ):
        value = res[key]
        assert isinstance(value, tuple)
        print(f"{key:28}{value[0]:>8}{value[1]:>10.2f}")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
