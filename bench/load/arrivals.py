"""When requests are sent: Poisson arrivals for open-loop load."""

from __future__ import annotations

import numpy as np


def poisson_arrivals(rate_per_s: float, num_requests: int, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``num_requests`` Poisson arrivals.

    The first request goes at t=0 so a run never opens with idle time.
    """
    if rate_per_s <= 0:
        raise ValueError("the arrival rate must be positive")
    if num_requests < 0:
        raise ValueError("the number of requests must be non-negative")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=num_requests)
    if num_requests:
        gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
