"""Pearson's chi-square test that two samples of tokens come from one distribution, for the sampling tests."""

from __future__ import annotations

import math
from collections import Counter


def chi2_critical(df: int, z: float = 3.29) -> float:
    """The chi-square statistic's upper quantile at the normal quantile ``z`` (3.29: p = 0.0005),
    by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Pearson's chi-square of two samples' counts being of one distribution, and its degrees of freedom.
    Tokens seen fewer than ``min_count`` times in both together share one bin, where the test's
    approximation would not hold for each alone."""
    rare = {k for k in set(a) | set(b) if a[k] + b[k] < min_count}
    a = _pooled(a, rare)
    b = _pooled(b, rare)
    keys = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for n, count in ((na, a[k]), (nb, b[k])):
            expected = n * total / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(keys) - 1


def _pooled(counts: Counter, rare: set) -> Counter:
    pooled: Counter = Counter()
    for k, n in counts.items():
        pooled["rare" if k in rare else k] += n
    return pooled
