"""Choosing which points of a long series to draw, so a 300k-step run stays a few MB of HTML.

Time series keep each bucket's minimum and maximum (a spike of one step stays visible);
sorted samples such as a CDF keep evenly spaced ranks. Both always keep the first and
last point, so a plot's extent does not change.
"""

from __future__ import annotations

import numpy as np

MAX_POINTS = 5000


def minmax_indices(y: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Sorted indices into ``y``: every point when it is short enough, else per-bucket extremes.

    At most ``max_points`` indices; NaNs are ignored when picking extremes.
    """
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, not {max_points}")
    buckets = (max_points - 2) // 2
    edges = np.linspace(1, n - 1, buckets + 1).astype(np.int64)  # interior points only
    low = np.where(np.isnan(y), np.inf, y)
    high = np.where(np.isnan(y), -np.inf, y)
    keep = [np.array([0, n - 1])]
    for start, stop in zip(edges[:-1], edges[1:]):
        if stop > start:
            keep.append(np.array([start + np.argmin(low[start:stop]), start + np.argmax(high[start:stop])]))
    return np.unique(np.concatenate(keep))


def even_indices(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """At most ``max_points`` evenly spaced indices into a length-``n`` sequence, ends included."""
    if n <= max_points:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))
