"""What the metrics add to one create, stop and command, measured directly.

    .venv/bin/python bench/bench_metrics.py [--n 200000]

An A/B of whole platforms (bench/bench_ab.py --baseline-env DSEC_METRICS=0) cannot
resolve 2% of a ~15 ms create on a loaded host: its A/A noise is larger. This times,
in one process, exactly the updates the edge makes for each (``Metrics.created`` and
``ended`` for a create and its stop, ``command_ended`` for a data-path command,
``exec_done`` for a control-route exec), on (``DSEC_METRICS`` unset) and off (``=0``),
so the cost can be set against the latencies bench_ab prints.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from dsec.api.exec import ExitInfo
from dsec.observe.metrics import Metrics

EXIT = ExitInfo(exit_code=0, duration=0.002)


def per_call_us(fn: Callable[[], None], n: int) -> float:
    """The best of three runs of ``n`` calls, in microseconds per call (the best: the
    least disturbed by the rest of the host)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def paths(m: Metrics) -> dict[str, Callable[[], None]]:
    """The metric updates of one operation, as the edge makes them."""

    def create_and_stop() -> None:
        m.created("container", 0.015)
        m.ended("container", "stopped")

    return {
        "create+stop": create_and_stop,
        "command": lambda: m.command_ended("container", EXIT),
        "exec": lambda: m.exec_done("container", 0.002),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    opts = ap.parse_args()
    on = paths(Metrics.from_env({}))
    off = paths(Metrics.from_env({"DSEC_METRICS": "0"}))
    print(f"load {os.getloadavg()[0]:.1f}; {opts.n} calls, best of 3")
    print(f"{'path':12} {'on us':>8} {'off us':>8}")
    for name in on:
        us_on, us_off = per_call_us(on[name], opts.n), per_call_us(off[name], opts.n)
        print(f"{name:12} {us_on:8.2f} {us_off:8.2f}")


if __name__ == "__main__":
    main()
