"""Reading histograms out of a /metrics body the way PromQL's histogram_quantile does."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def families(body: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body)}


def buckets(body: str, name: str, **labels: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram series, in bound order."""
    family = families(body)[name]
    found = [
        (float(s.labels["le"]), s.value)
        for s in family.samples
        if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sorted(found)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """PromQL's histogram_quantile over (upper bound, cumulative count) pairs ending with +Inf."""
    total = cumulative[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in cumulative:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound  # the highest finite bound, as PromQL does
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    raise AssertionError("cumulative counts end below the total")
