"""Cost of per-sandbox disk quotas (issue 5): what create and teardown pay for them.

    .venv/bin/python bench/bench_disk.py [--n 500]

On a scratch btrfs image (dsec.resources.disk), side by side in one run: a sandbox
directory as a quota subvolume (subvolume create + quota-group limit + rootfs/upper/work)
against the same four plain directories on the host file system; teardown as one
subvolume destroy against ``shutil.rmtree``; and the limit probe that runs after an
abnormal command and in the periodic scan. Writes bench/results/disk.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsec.resources import cgroups  # noqa: E402
from dsec.resources.disk import GiB, SandboxDisk  # noqa: E402
from dsec.security.limits import read_cgroup_counters  # noqa: E402


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1e3, 4),
        "p99_ms": round(s[int(len(s) * 0.99)] * 1e3, 4),
    }


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    n = ap.parse_args().n
    base = Path(tempfile.mkdtemp(prefix="dsec-bench-disk-", dir="/tmp"))
    disk = SandboxDisk(base / "sandboxes", base / "sandboxes.img", size_bytes=8 * GiB)
    plain = base / "plain"
    plain.mkdir()
    try:
        disk.open()
        if not disk.enabled:
            raise SystemExit("btrfs quotas unavailable here (see the log)")

        def quota_dir(p: Path) -> None:
            disk.create_dir(p, limit_bytes=10 * GiB)
            for sub in ("rootfs", "upper", "work"):
                (p / sub).mkdir()

        def plain_dir(p: Path) -> None:
            p.mkdir()
            for sub in ("rootfs", "upper", "work"):
                (p / sub).mkdir()

        quota_dirs = [base / "sandboxes" / f"s{i}" for i in range(n)]
        plain_dirs = [plain / f"s{i}" for i in range(n)]
        create_q = [timed(functools.partial(quota_dir, p)) for p in quota_dirs]
        create_p = [timed(functools.partial(plain_dir, p)) for p in plain_dirs]
        remove_q = [timed(functools.partial(disk.remove_dir, p)) for p in quota_dirs]
        remove_p = [timed(functools.partial(shutil.rmtree, p)) for p in plain_dirs]
        host = cgroups.detect()
        probe = [
            timed(lambda: (read_cgroup_counters(host, "/"), disk.usage(256))) for _ in range(n)
        ]
        result = {
            "n": n,
            "create_quota_subvolume": stats(create_q),
            "create_plain_dirs": stats(create_p),
            "teardown_subvolume_destroy": stats(remove_q),
            "teardown_rmtree": stats(remove_p),
            "limit_probe": stats(probe),
        }
    finally:
        for p in (base / "sandboxes").iterdir() if disk.enabled else ():
            disk.remove_dir(p)
        disk.close()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    out = REPO / "bench" / "results" / "disk.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
