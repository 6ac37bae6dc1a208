"""Which adapter a request uses: Zipf popularity over a ranked list."""

from __future__ import annotations

import numpy as np


def zipf_weights(n: int, exponent: float) -> np.ndarray:
    """Probabilities of ranks 1..n, proportional to 1 / rank**exponent."""
    if n < 1:
        raise ValueError("need at least one item")
    if exponent < 0:
        raise ValueError("the Zipf exponent must be non-negative")
    weights = 1.0 / np.arange(1, n + 1, dtype=float) ** exponent
    return weights / weights.sum()


class ZipfSampler:
    """Draws items, the first the most popular, with a seeded generator."""

    def __init__(self, items: list[str], exponent: float = 1.0, seed: int = 0) -> None:
        self.items = list(items)
        self.weights = zipf_weights(len(self.items), exponent)
        self._rng = np.random.default_rng(seed)

    def sample(self) -> str:
        return self.items[int(self._rng.choice(len(self.items), p=self.weights))]
