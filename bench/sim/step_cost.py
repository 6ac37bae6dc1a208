"""Fit the step-time cost model bench/sim/slo.py runs on, from the engine's measured steps.

    step_s = base_s + per_prefill_token_s * prefill_tokens
                    + per_decode_seq_s * decode_rows + per_context_token_s * context_tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")


@dataclass(frozen=True)
class StepSample:
    duration_s: float
    prefill_tokens: int
    decode_rows: int
    context_tokens: int  # KV positions the step's rows attend over, summed over rows


def fit_step_cost(samples: Sequence[StepSample]) -> dict:
    """Least squares with every coefficient kept non-negative.

    Written here rather than taken from scipy.optimize.nnls to keep scipy out
    of the bench's dependencies: with four features, dropping the most negative
    coefficient and refitting until none is negative is exact enough.
    """
    if len(samples) < len(COEFFICIENTS):
        raise ValueError(f"need at least {len(COEFFICIENTS)} steps to fit, got {len(samples)}")
    x = np.array([[1.0, s.prefill_tokens, s.decode_rows, s.context_tokens] for s in samples])
    y = np.array([s.duration_s for s in samples])
    active = list(range(len(COEFFICIENTS)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(len(COEFFICIENTS))
    full[active] = np.clip(coef, 0, None)
    predicted = x @ full
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
    return {**dict(zip(COEFFICIENTS, map(float, full))), "r2": r2, "steps": len(samples)}
