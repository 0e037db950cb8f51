"""What a verify step costs now, against the verifier it replaced, in one run.

    .venv/bin/python bench/bench_verify.py [--rounds 30] [--baseline-rev 22f5ad9]

Two platforms side by side: this tree, and the baseline revision (the verifier that
ran the grader in the agent's own world) checked out in a temporary git worktree and
started from its own sources. Rounds are interleaved (new, old, new, old, ...) so load
on a shared machine hits both alike. Each round creates a busybox sandbox with an
inline protected answer and a graded work tree, then times, through the SDK / HTTP:

- ``exec``: the same grader command run in the agent's sandbox (the floor: no verifier);
- ``old verify``: the baseline's verify (agent frozen, verifier root = agent's upper);
- ``isolated``: the new verify, agent frozen and thawed after (snapshot + pristine root);
- ``fresh``: the new verify that stops the agent first (includes the stop);
- ``old verify + stop``: what fresh replaces.

Work trees: ``small`` (one answer file), ``layer repo`` (a 1,000-file, 8 MiB repository
in a workspace layer, one file changed by the agent: only the change is copied) and
``repo`` (the same written by the agent itself: all of it is copied). Prints
p50/p99 per case and the ratios new/old; writes bench/results/verify.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import platform_process  # noqa: E402

from bench.baseline import baseline_tree  # noqa: E402
from bench.stats import summary  # noqa: E402
from dsec import DSecClient, DSecContainerRunArgs, ProtectedMount  # noqa: E402

GRADER = '[ "$(cat /work/answer.txt)" = "$(cat /grader/expected.txt)" ]'
TREES = {
    "small": "mkdir -p /work && echo 42 > /work/answer.txt",
    # The task's repository in a workspace layer (1,000 files, 8 MiB), one file changed.
    "layer repo": "echo 42 > /work/answer.txt && echo changed >> /work/src/f7",
    "repo": "mkdir -p /work/src && echo 42 > /work/answer.txt && cd /work/src && i=0;"
    " while [ $i -lt 1000 ]; do dd if=/dev/urandom of=f$i bs=8k count=1 2>/dev/null;"
    " i=$((i+1)); done",
}


def spec(image: str, tree: str) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(
        container_image=image,
        workspace="bench-repo:v1" if tree == "layer repo" else None,
        memory_limit_mb=128,
        protected=[ProtectedMount(path="/grader", files={"expected.txt": "42\n"})],
    )


async def timed_old_verify(http: httpx.AsyncClient, sandbox_id: str) -> float:
    t = time.perf_counter()
    resp = await http.post(f"/v1/sandboxes/{sandbox_id}/verify", json={"command": GRADER})
    elapsed = time.perf_counter() - t
    resp.raise_for_status()
    assert resp.json()["exit_code"] == 0, resp.text
    return elapsed


async def one_round(
    new: DSecClient,
    old: DSecClient,
    old_http: httpx.AsyncClient,
    tree: str,
    out: dict[str, list[float]],
) -> None:
    for name, client in (("new", new), ("old", old)):
        sb = await client.run_container(spec("busybox:latest", tree))
        try:
            await sb.run_shell(TREES[tree], timeout=300)
            t = time.perf_counter()
            # The same work in the agent's sandbox (it has no answer: compare with itself).
            res = await sb.run_shell(GRADER.replace("/grader/expected.txt", "/work/answer.txt"))
            out["exec"].append(time.perf_counter() - t)
            assert res.exit_code == 0
            if name == "new":
                t = time.perf_counter()
                v = await sb.verify(GRADER, graded=["/work"], mode="isolated")
                out["isolated"].append(time.perf_counter() - t)
                assert v.passed, v
                t = time.perf_counter()
                v = await sb.verify(GRADER, graded=["/work"])
                out["fresh"].append(time.perf_counter() - t)
                assert v.passed, v
            else:
                out["old verify"].append(await timed_old_verify(old_http, sb.id))
                t = time.perf_counter()
                await timed_old_verify(old_http, sb.id)
                await sb.stop()
                out["old verify + stop"].append(time.perf_counter() - t)
        finally:
            await sb.stop()


async def run(opts: argparse.Namespace, new_plat: Any, old_plat: Any) -> dict[str, Any]:
    results: dict[str, Any] = {"load_start": os.getloadavg()[0]}
    async with (
        DSecClient(new_plat.url, new_plat.api_key, timeout=300) as new,
        DSecClient(old_plat.url, old_plat.api_key, timeout=300) as old,
        httpx.AsyncClient(
            base_url=old_plat.url,
            headers={"Authorization": f"Bearer {old_plat.api_key}"},
            timeout=300,
        ) as old_http,
    ):
        with tempfile.TemporaryDirectory() as src:
            (Path(src) / "src").mkdir()
            for i in range(1000):
                (Path(src) / "src" / f"f{i}").write_bytes(os.urandom(8192))
            for client in (new, old):
                await client.build_image("busybox")
                await client.build_layer("bench-repo:v1", "dir", src, prefix="/work")
        for tree in TREES:
            samples: dict[str, list[float]] = {
                k: [] for k in ("exec", "old verify", "isolated", "fresh", "old verify + stop")
            }
            rounds = opts.rounds if tree == "small" else max(5, opts.rounds // 3)
            for _ in range(2):  # warm-up
                await one_round(new, old, old_http, tree, {k: [] for k in samples})
            for _ in range(rounds):
                await one_round(new, old, old_http, tree, samples)
            results[tree] = {k: summary(v) for k, v in samples.items()}
    results["load_end"] = os.getloadavg()[0]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--baseline-rev", default="22f5ad9", help="the verifier to compare with")
    opts = parser.parse_args()
    with (
        baseline_tree(opts.baseline_rev) as base,
        platform_process() as new_plat,
        platform_process(PYTHONPATH=str(base / "src")) as old_plat,
    ):
        results = asyncio.run(run(opts, new_plat, old_plat))
    print(f"load {results['load_start']:.1f} -> {results['load_end']:.1f}")
    for tree in TREES:
        r = results[tree]
        print(f"\n{tree} work tree")
        for case, s in r.items():
            print(
                f"  {case:<18} p50 {s['p50_ms']:8.1f} ms   p99 {s['p99_ms']:8.1f} ms  (n={s['n']})"
            )
        iso = r["isolated"]["p50_ms"] / r["old verify"]["p50_ms"]
        fr = r["fresh"]["p50_ms"] / r["old verify + stop"]["p50_ms"]
        iso99 = r["isolated"]["p99_ms"] / r["old verify"]["p99_ms"]
        print(f"  ratio isolated/old verify: p50 {iso:.2f}  p99 {iso99:.2f}")
        print(f"  ratio fresh/(old verify + stop): p50 {fr:.2f}")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
