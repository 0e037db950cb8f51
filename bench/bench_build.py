"""Dockerfile builds cold and cached, and the OCI registry as a layer store against
our own store server, in one run.

1. A Dockerfile (COPY of a context of N MiB, several RUN steps writing files) is built
   on a fresh platform: ``cold`` runs every step (``no_cache``), ``cached`` rebuilds the
   unchanged Dockerfile; and a two-stage Dockerfile (the context joined in a build
   stage, one ``COPY --from`` of the result into the final stage, cold and cached)
   against that single-stage baseline. All four rotate, so host noise falls on each.
2. The layer store interface (what ``dsec layer push/pull`` and the lazy loader use)
   against Debian's distribution registry (``oci+http://``, htpasswd auth) and
   ``dsec store serve``, interleaved: push of a fresh EROFS layer (blob, chunk index,
   reference), whole fetch, and 1 MiB Range reads as dsec-lazyfs makes them.

    .venv/bin/python bench/bench_build.py [--rounds 5] [--context-mib 16] [--layer-mib 128]
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
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402
from tests.oci_registry import registry  # noqa: E402

from bench.bench_lazy import TOKEN, store_server  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecClient  # noqa: E402
from dsec.images.remote.client import RemoteStore, open_remote  # noqa: E402
from dsec.images.remote.dirstore import DirStore  # noqa: E402
from dsec.images.remote.publish import publish_tree  # noqa: E402
from dsec.sdk.dockerfile import build_dockerfile  # noqa: E402

DOCKERFILE = """\
FROM busybox:latest
ENV APP=/srv/app
WORKDIR /srv/app
COPY data/ ./data/
RUN mkdir -p /opt/tool && dd if=/dev/urandom of=/opt/tool/blob bs=1M count=4 2>/dev/null
RUN for i in $(seq 1 200); do echo "line $i" > /srv/app/f$i.txt; done
RUN rm -f /srv/app/f1.txt && echo done > /srv/app/built
"""
MULTI_DOCKERFILE = """\
FROM busybox:latest AS build
COPY data/ /src/data/
RUN mkdir -p /out && cat /src/data/* > /out/joined.bin
FROM busybox:latest
COPY --from=build /out/joined.bin /app/joined.bin
"""


def make_context(root: Path, mib: int) -> Path:
    ctx = root / "ctx"
    data = ctx / "data"
    data.mkdir(parents=True)
    rng = random.Random(7)
    for i in range(max(1, mib)):
        (data / f"part{i:03d}.bin").write_bytes(rng.randbytes(1 << 20))
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "Dockerfile.multi").write_text(MULTI_DOCKERFILE)
    (ctx / ".dockerignore").write_text("Dockerfile*\n")
    return ctx


async def bench_dockerfile(url: str, key: str, ctx: Path, rounds: int) -> dict[str, Any]:
    files = {"": ctx / "Dockerfile", "multi_": ctx / "Dockerfile.multi"}
    times: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    modes = ["cold", "cached", "multi_cold", "multi_cached"]
    async with DSecClient(url, key, timeout=None) as client:
        await client.build_image("busybox")
        for df in files.values():
            await build_dockerfile(client, df, ctx, "benchbuild:warm")
        for i in range(rounds):
            for mode in modes[i % 4 :] + modes[: i % 4]:
                prefix = "multi_" if mode.startswith("multi_") else ""
                cold = mode.endswith("cold")
                t0 = time.perf_counter()
                res = await build_dockerfile(
                    client, files[prefix], ctx, f"benchbuild:{prefix}1", no_cache=cold
                )
                times.setdefault(mode, []).append(time.perf_counter() - t0)
                if cold:
                    for s in res.steps:
                        if s.layer is not None:
                            name = f"{prefix}{s.instruction}@{s.line}"
                            steps.setdefault(name, []).append(s.seconds)
                else:
                    assert res.cached_steps == len(res.steps), "a rebuild missed the cache"
    return {
        **{mode: summary(times[mode]) for mode in modes},
        "cold_step_p50_ms": {k: summary(v)["p50_ms"] for k, v in steps.items()},
    }


def make_layers(root: Path, n: int, mib: int) -> tuple[DirStore, list[Any]]:
    """n distinct EROFS layers of ~mib MiB (random files), blob + chunk index each."""
    staging = DirStore(root / "staging")
    infos = []
    for i in range(n):
        tree = root / f"tree{i}"
        (tree / "data").mkdir(parents=True)
        rng = random.Random(100 + i)
        for j in range(max(1, mib // 4)):
            (tree / "data" / f"f{j:03d}").write_bytes(rng.randbytes(4 << 20))
        infos.append(publish_tree(staging, tree, "benchlayer", f"v{i}"))
        shutil.rmtree(tree)
    return staging, infos


async def range_reads(
    url: str, headers: dict[str, str], size: int, count: int, rng: random.Random
) -> list[float]:
    out = []
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        for _ in range(count):
            off = rng.randrange(0, max(1, size - (1 << 20)))
            t0 = time.perf_counter()
            r = await http.get(url, headers={"Range": f"bytes={off}-{off + (1 << 20) - 1}"})
            assert r.status_code == 206, r.status_code
            out.append(time.perf_counter() - t0)
    return out


async def bench_stores(stores: dict[str, RemoteStore], root: Path, rounds: int, mib: int) -> Any:
    staging, infos = make_layers(root, rounds * len(stores), mib)
    push: dict[str, list[float]] = {k: [] for k in stores}
    fetch: dict[str, list[float]] = {k: [] for k in stores}
    ranges: dict[str, list[float]] = {k: [] for k in stores}
    rng = random.Random(1)
    layer = iter(infos)
    for i in range(rounds):
        names = list(stores) if i % 2 == 0 else list(reversed(stores))
        for name in names:
            store = stores[name]
            info = next(layer)
            index = staging.get_index(info.digest)
            assert index is not None
            t0 = time.perf_counter()
            await store.push_blob(info.digest, staging.blob_path(info.digest))
            await store.push_index(info.digest, index)
            await store.put_ref(info)
            push[name].append(time.perf_counter() - t0)
            dest = root / f"fetched-{name}"
            t0 = time.perf_counter()
            await store.fetch_blob(info.digest, dest)
            fetch[name].append(time.perf_counter() - t0)
            dest.unlink()
            auth = await store.lazy_authorization()
            url = f"{store.location}{store.lazy_blob_prefix}{info.digest}"
            headers = {"Authorization": auth} if auth else {}
            ranges[name] += await range_reads(url, headers, info.size_bytes, 32, rng)
    mb = infos[0].size_bytes / 1e6
    return {
        name: {
            "layer_mb": round(mb, 1),
            "push": summary(push[name]),
            "fetch": summary(fetch[name]),
            "fetch_mb_s": round(mb / (summary(fetch[name])["p50_ms"] / 1000), 1),
            "range_1mib": summary(ranges[name]),
        }
        for name in stores
    }


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-bb-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run_stores(work: Path, rounds: int, mib: int) -> Any:
    with registry(htpasswd={"dsec": TOKEN}) as reg, store_server(work / "store") as store_url:
        stores = {
            "registry": open_remote(
                reg.store_url(f"bench/{secrets.token_hex(3)}"), reg.credentials
            ),
            "store_server": open_remote(store_url, TOKEN),
        }
        try:
            return await bench_stores(stores, work, rounds, mib)
        finally:
            for s in stores.values():
                await s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context-mib", type=int, default=16)
    ap.add_argument("--layer-mib", type=int, default=128)
    opts = ap.parse_args()
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    with workdir() as work:
        ctx = make_context(work, opts.context_mib)
        with platform_process() as plat:
            out["dockerfile"] = asyncio.run(
                bench_dockerfile(plat.url, plat.api_key, ctx, opts.rounds)
            )
        out["layer_store"] = asyncio.run(run_stores(work, opts.rounds, opts.layer_mib))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
