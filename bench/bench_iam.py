"""What IAM adds to the create path: charge + rebind + release, and the role check.

    .venv/bin/python bench/bench_iam.py [--n 2000] [--no-pg]

On SQLite (the single-node default, WAL as `dsec up` configures it) and on a real
PostgreSQL 15 (started by tests.pg, fsync off as in the tests), with a 3-level project
chain (``rl/math/job``), each with quotas, so every charge touches three usage rows:
a create costs ``require`` (in memory) + ``charge`` (provisional id) + ``rebind``; a
stop costs ``release``. Writes bench/results/iam.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsec.api.iam import QuotaLimits  # noqa: E402
from dsec.control.db import make_engine, migrate, sqlite_url  # noqa: E402
from dsec.control.iam import IAM, Role  # noqa: E402


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1000, 3),
        "p99_ms": round(s[int(len(s) * 0.99) - 1] * 1000, 3),
        "mean_ms": round(statistics.fmean(s) * 1000, 3),
    }


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


async def run(url: str, n: int) -> dict[str, dict[str, float]]:
    engine = make_engine(url)
    try:
        await migrate(engine)
        iam = IAM(engine)
        await iam.ensure_bootstrap()
        for p in ("rl", "rl/math", "rl/math/job"):
            await iam.create_project("admin", p)
        await iam.set_quota("admin", "rl", QuotaLimits(max_sandboxes=n + 10, cpu_cores=n))
        await iam.set_quota("admin", "rl/math", QuotaLimits(max_sandboxes=n + 10))
        await iam.set_quota("admin", "rl/math/job", QuotaLimits(memory_mb=64 * (n + 10)))
        for i in range(50):  # warm the pool and caches
            await iam.charge("rl/math/job", f"warm{i}", 0.5, 64)
            await iam.release(f"warm{i}")
        require: list[float] = []
        charge: list[float] = []
        create: list[float] = []
        release: list[float] = []
        for i in range(n):
            require.append(
                await timed(lambda: iam.require("admin", Role.RUNTIME, "rl/math/job", "bench"))
            )
            pid = iam.provisional_id()
            sid = f"e0-{i:016x}"
            t0 = time.perf_counter()
            await iam.charge("rl/math/job", pid, 0.5, 64)
            t1 = time.perf_counter()
            await iam.rebind(pid, sid)
            t2 = time.perf_counter()
            charge.append(t1 - t0)
            create.append(t2 - t0)
        for i in range(n):
            release.append(await timed(lambda i=i: iam.release(f"e0-{i:016x}")))  # type: ignore[misc]
        return {
            "require (in memory)": stats(require),
            "charge": stats(charge),
            "charge + rebind (added to create)": stats(create),
            "release (added to stop)": stats(release),
        }
        await iam.close()
    finally:
        await engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--no-pg", action="store_true")
    args = ap.parse_args()
    results: dict[str, object] = {"n": args.n, "chain": "rl/math/job (3 usage rows)"}
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = asyncio.run(run(sqlite_url(Path(tmp) / "control.db"), args.n))
    if not args.no_pg:
        from tests.pg import PostgresServer

        server = PostgresServer()
        try:
            results["postgresql"] = asyncio.run(run(server.url, args.n))
        finally:
            server.stop()
    print(json.dumps(results, indent=2))
    out = REPO / "bench" / "results" / "iam.json"
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
