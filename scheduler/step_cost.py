"""The step cost model: a step's predicted duration from what it computes, fitted online to the engine's steps.

    step_s = base_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_rows
                    + per_context_token_s * context_tokens + per_attention_pair_s * attention_pairs
                    + per_scored_row_s * scored_rows

The features are those bench/sim/step_cost.py fits offline and bench/sim/slo.py runs on, taken from a
plan by ``step_features`` (each chunk's share: ``StepFeatures.of`` in scheduler/plan.py, which the
step builder also keeps a running sum of while it plans). Online, the fit is exponentially weighted least
squares over the last ``memory_steps`` or so steps, pulled gently toward the prior coefficients
(so it predicts before any step and stays defined while, say, no step has had prefill in a
while), with every coefficient kept non-negative.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from scheduler.config import StepCost
from scheduler.plan import StepFeatures, StepPlan

# Typical feature sizes, so that the prior's pull weighs about as much as PRIOR_STEPS steps of
# that size on each coefficient, whatever its units.
_SCALES = np.array([1.0, 64.0, 8.0, 4096.0, 65536.0, 64.0])
_N = len(_SCALES)
PRIOR_STEPS = 2.0
# Past its first WARMUP_STEPS steps (which correct a prior however far off), an observed step
# counts at most OUTLIER_FACTOR times its prediction: one stall (a page fault storm, a GC pause)
# must not take the fit with it for the next few hundred steps.
WARMUP_STEPS = 20
OUTLIER_FACTOR = 1.5
# Past its first WARMUP_STEPS steps the fit is solved again every REFIT_STEPS observations, not after each
# one: it weighs about the last ``memory_steps`` steps, so a few more barely move it, and a solve a step
# (a handful of numpy calls, after a forward that streamed the weights through the caches) was a visible
# share of a small model's single-stream decode step (docs/performance.md). The outlier clip uses it too.
REFIT_STEPS = 16
# Observations wait in a list and join the weighted sums this many at a time (or before a solve): one
# small matrix product instead of three numpy operations a step, which after a forward that streamed
# the weights through the caches cost a small model's decode step more than the arithmetic suggests.
FOLD_STEPS = 16
# The fit is one set of coefficients for every kind of step, so it can sit low for the kind a latency
# bound cuts (a stream's decode beside a chunk deep in a long prompt), and each such step then runs
# past its bound. ``overrun()`` is how far they did: the OVERRUN_QUANTILE of duration over prediction
# among the last OVERRUN_MEMORY bounded steps (1 until OVERRUN_MIN_STEPS were seen, at most OVERRUN_MAX);
# a bounded step is planned that much shorter (step_budget.StepTimeBound).
OVERRUN_MEMORY = 64
OVERRUN_MIN_STEPS = 8
OVERRUN_QUANTILE = 0.98  # a stream's gap is judged at its p99, and one stall (a GC pause) must not count
OVERRUN_MAX = 2.0


__all__ = ["StepCostModel", "StepFeatures", "predict", "step_features"]


def step_features(plan: StepPlan) -> StepFeatures:
    """What ``plan`` computes; reads only the chunks' positions, so it holds before and after ``update``."""
    return sum((StepFeatures.of(c) for c in plan.chunks), StepFeatures())


def predict(cost: StepCost, features: StepFeatures) -> float:
    return sum(c * x for c, x in zip(cost.as_tuple(), features.row()))


class StepCostModel:
    """The online fit; ``coefficients()`` refits lazily after new observations (``REFIT_STEPS``)."""

    def __init__(self, prior: StepCost, memory_steps: int = 200) -> None:
        if memory_steps < 1:
            raise ValueError("step_cost_memory_steps must be at least 1")
        if min(prior.as_tuple()) < 0:
            raise ValueError("the step cost prior's coefficients must not be negative")
        self.decay = 1.0 - 1.0 / memory_steps
        self._prior = np.array(prior.as_tuple())
        self._ridge = PRIOR_STEPS * _SCALES**2
        self._xtx = np.zeros((_N, _N))
        self._xty = np.zeros(_N)
        self._pending: list[tuple[float, ...]] = []  # (features..., duration) observed, not yet in the sums
        self._fit = prior
        self._fit_at = 0  # ``observed`` when ``_fit`` was solved
        self.observed = 0
        self._overruns: deque[float] = deque(maxlen=OVERRUN_MEMORY)

    @property
    def prior(self) -> StepCost:
        """The coefficients the fit is pulled toward."""
        return StepCost(*(float(c) for c in self._prior))

    def observe(self, features: StepFeatures, duration_s: float) -> None:
        if duration_s < 0:
            raise ValueError("a step's duration must not be negative")
        y = duration_s
        if self.observed >= WARMUP_STEPS:
            y = min(y, OUTLIER_FACTOR * max(predict(self.coefficients(), features), 1e-6))
        self._pending.append((*features.row(), y))
        if len(self._pending) >= FOLD_STEPS:
            self._fold()
        self.observed += 1

    def _fold(self) -> None:
        """The pending observations into the decayed sums, each weighted as if added one step at a time."""
        if not self._pending:
            return
        rows = np.array(self._pending)
        self._pending.clear()
        x, y = rows[:, :_N], rows[:, _N]
        weighted = x * (self.decay ** np.arange(len(rows) - 1, -1, -1))[:, None]
        older = self.decay ** len(rows)
        self._xtx = older * self._xtx + weighted.T @ x
        self._xty = older * self._xty + weighted.T @ y

    def observe_step(self, plan: StepPlan, duration_s: float) -> None:
        """Learn from a finished step of ``plan``; one planned under a latency bound also counts in ``overrun()``."""
        self.observe(step_features(plan), duration_s)
        if plan.bound_s is not None:
            self._overruns.append(duration_s / max(plan.predicted_s, 1e-9))

    def overrun(self) -> float:
        """How many times their prediction recent bounded steps lasted (``OVERRUN_QUANTILE``), at least 1."""
        if len(self._overruns) < OVERRUN_MIN_STEPS:
            return 1.0
        ratios = sorted(self._overruns)
        return min(OVERRUN_MAX, max(1.0, ratios[int(OVERRUN_QUANTILE * (len(ratios) - 1))]))

    def coefficients(self) -> StepCost:
        """The fit: solved again after each of the first ``WARMUP_STEPS`` observations, then every ``REFIT_STEPS``."""
        if self.observed - self._fit_at >= (REFIT_STEPS if self.observed > WARMUP_STEPS else 1):
            self._fit, self._fit_at = self._solve(), self.observed
        return self._fit

    def predict(self, features: StepFeatures) -> float:
        return predict(self.coefficients(), features)

    def _solve(self) -> StepCost:
        # Ridge toward the prior: minimise |y - Xc|^2 + sum(ridge * (c - prior)^2). A negative
        # coefficient is fixed at zero and the rest refitted (active set; six features, at most
        # six rounds). Written here because scipy's nnls has no ridge term and scipy is no dependency.
        self._fold()
        a = self._xtx + np.diag(self._ridge)
        b = self._xty + self._ridge * self._prior
        active = list(range(_N))
        coef = np.zeros(_N)
        while active:
            sol = np.linalg.solve(a[np.ix_(active, active)], b[active])
            if (sol >= 0).all():
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return StepCost(*(float(c) for c in coef))
