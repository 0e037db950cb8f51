"""Percentiles for the benches: nearest-rank, on the samples as measured."""

from __future__ import annotations

import statistics


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(samples_s: list[float]) -> dict[str, float]:
    """n, p50 and p99 in milliseconds of samples in seconds."""
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99)}
