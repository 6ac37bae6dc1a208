"""The step-time cost model fit recovers known coefficients and never goes negative."""

from __future__ import annotations

import random

import pytest

from bench.sim.step_cost import StepSample, fit_step_cost


def _samples(base, prefill, decode, context, noise=0.0, n=200):
    rng = random.Random(0)
    out = []
    for _ in range(n):
        p, d, c = rng.randint(0, 400), rng.randint(0, 32), rng.randint(0, 8000)
        out.append(StepSample(base + prefill * p + decode * d + context * c + rng.gauss(0, noise), p, d, c))
    return out


def test_fit_recovers_the_coefficients_of_noiseless_steps():
    fit = fit_step_cost(_samples(0.01, 2e-4, 1e-3, 3e-7))
    assert fit["base_s"] == pytest.approx(0.01, rel=1e-6)
    assert fit["per_prefill_token_s"] == pytest.approx(2e-4, rel=1e-6)
    assert fit["per_decode_seq_s"] == pytest.approx(1e-3, rel=1e-6)
    assert fit["per_context_token_s"] == pytest.approx(3e-7, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0)


def test_fit_keeps_coefficients_non_negative_when_a_feature_does_not_matter():
    fit = fit_step_cost(_samples(0.01, 2e-4, 0.0, 0.0, noise=2e-3))
    assert all(fit[k] >= 0 for k in ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s"))
    assert fit["per_prefill_token_s"] == pytest.approx(2e-4, rel=0.05)


def test_fit_needs_enough_steps():
    with pytest.raises(ValueError):
        fit_step_cost(_samples(0.01, 0, 0, 0, n=2))
