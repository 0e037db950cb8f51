"""What the per-request sandbox check (dsec.apiserver.sandboxaccess) adds to a route.

    .venv/bin/python bench/bench_sandbox_access.py [--n 20000]

Interleaved in one run, over a real IAM on SQLite (its default 60 s role cache, as an
apiserver runs it): the baseline is the check without IAM (single-user, a cluster
edge: the id pattern only), then an admin of every project (one cached role read),
then a tenant on its own sandbox (two cached role reads and the remembered project).
The sandbox records come from an in-memory table, as Edge.get reads its own; on a
cluster apiserver the first check of a sandbox costs one edge round trip more, the
later ones nothing. Writes bench/results/sandbox_access.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsec.api.iam import PrincipalCreate, Role  # noqa: E402
from dsec.api.sandbox import SandboxInfo, SandboxState  # noqa: E402
from dsec.api.spec import BackendKind, DSecContainerRunArgs  # noqa: E402
from dsec.apiserver.auth import Authenticator  # noqa: E402
from dsec.apiserver.sandboxaccess import SandboxAccess  # noqa: E402
from dsec.control.db import make_engine, migrate, sqlite_url  # noqa: E402
from dsec.control.iam import IAM  # noqa: E402
from dsec.control.keys import KeyStore  # noqa: E402

SID = "e0-" + "a" * 16


class Records:
    def __init__(self, info: SandboxInfo) -> None:
        self.infos = {info.id: info}

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self.infos[sandbox_id]


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": round(statistics.median(s) * 1e6, 2),
        "p99_us": round(s[int(len(s) * 0.99) - 1] * 1e6, 2),
    }


async def run(db: Path, n: int) -> dict[str, dict[str, float]]:
    engine = make_engine(sqlite_url(db))
    try:
        await migrate(engine)
        iam = IAM(engine)
        await iam.ensure_bootstrap()
        await iam.create_project("admin", "t")
        await iam.create_principal("admin", PrincipalCreate(name="bob", default_project="t"))
        await iam.grant("admin", "bob", "t", Role.RUNTIME)
        now = datetime.now(UTC)
        info = SandboxInfo(
            id=SID,
            backend=BackendKind.CONTAINER,
            state=SandboxState.RUNNING,
            image="busybox:latest",
            created_at=now,
            updated_at=now,
            edge="e0",
            spec=DSecContainerRunArgs(container_image="busybox:latest", project="t"),
        )
        recs = Records(info)
        auth = Authenticator(KeyStore(engine))
        off = SandboxAccess(recs, None, auth)
        on = SandboxAccess(recs, iam, auth)
        cases: dict[str, tuple[SandboxAccess, str]] = {
            "baseline: no IAM": (off, "bob"),
            "admin of every project": (on, "admin"),
            "tenant, own sandbox": (on, "bob"),
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(n):
            for name, (access, principal) in cases.items():  # interleaved
                t = time.perf_counter()
                await access.require(principal, SID)
                samples[name].append(time.perf_counter() - t)
        await iam.close()
        return {k: stats(v) for k, v in samples.items()}
    finally:
        await engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, object] = {"n": args.n}
        results.update(asyncio.run(run(Path(tmp) / "control.db", args.n)))
    print(json.dumps(results, indent=2))
    out = REPO / "bench" / "results" / "sandbox_access.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
