"""Robust spread for timings, shared by the benchmark and the mode comparison."""
from __future__ import annotations

import statistics


def jitter(values: list[float]) -> float:
    """1.4826 x median absolute deviation: a spread that one slow outlier does not move
    (tf_cnn_benchmarks' jitter; equals the standard deviation for normal data)."""
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)
