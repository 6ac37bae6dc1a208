"""Percentiles and latency summaries shared by the benches and the load generator."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(values: Sequence[float], quantiles: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "mean": ...} of ``values``."""
    out: dict[str, float | None] = {f"p{q:g}": percentile(values, q) for q in quantiles}
    out["mean"] = float(np.mean(values)) if len(values) else None
    return out
