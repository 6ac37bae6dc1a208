"""Prompt logprobs cost their step: the scored rows are a feature of the step cost and shrink a scoring chunk.

A request asking for prompt logprobs puts each prefill row through the LM head and a softmax over the
vocabulary (engine/prompt_scoring.py). A step that does that was predicted as a plain prefill, so the
inter-token bound planned it as large as a plain chunk and every stream beside it waited for the
scores too. The scheduler knows a sequence scores by ``reads_prefix_cache`` being False (set by the
engine until its prompt is scored), and which rows it scores from its positions.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from scheduler import Scheduler, SchedulerConfig, Sequence
from scheduler.config import StepCost, TierConfig
from scheduler.plan import ScheduledChunk, StepFeatures, attention_pairs
from scheduler.step_budget import PLAN_TO
from scheduler.step_cost import StepCostModel, predict, step_features

from scheduler_driver import engine_step

# A CPU-like step whose scored rows each cost most of a prefill token (a small model's LM head).
COST = StepCost(base_s=0.01, per_prefill_token_s=1e-3, per_decode_seq_s=1e-4, per_context_token_s=1e-6,
                per_scored_row_s=8e-4)


def config(**kw) -> SchedulerConfig:
    tiers = (TierConfig("premium", 0, ttft_slo_s=None), TierConfig("standard", 1, ttft_slo_s=None))
    base = dict(num_blocks=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096,
                standard_min_share=0.0, step_cost_prior=COST, tiers=tiers, max_step_s=0.1)
    return SchedulerConfig(**{**base, **kw})


def prompt(tokens: int, scores: bool, tenant: str = "scorer") -> Sequence:
    seq = Sequence(f"{tenant}-{tokens}", [(i * 7) % 900 + 1 for i in range(tokens)], tenant=tenant, max_tokens=1)
    seq.reads_prefix_cache = not scores  # as engine/request_state.py sets it for prompt_logprobs
    return seq


def test_a_scoring_chunk_counts_each_prompt_row_that_predicts_a_next_prompt_token():
    seq = prompt(100, scores=True)
    assert StepFeatures.of(ScheduledChunk(seq, 0, 32)).scored_rows == 32
    assert StepFeatures.of(ScheduledChunk(seq, 96, 4)).scored_rows == 3  # row 99 predicts no prompt token
    seq.recompute_until = 50  # preempted at 50: rows below it were scored before and are not again
    assert StepFeatures.of(ScheduledChunk(seq, 40, 20)).scored_rows == 10
    assert StepFeatures.of(ScheduledChunk(prompt(100, scores=False), 0, 32)).scored_rows == 0


def test_beside_streams_a_scoring_chunk_is_smaller_and_its_step_fits_the_target_with_its_scores():
    chunks = {}
    for scores in (False, True):
        sched = Scheduler(config())
        streams = [Sequence(f"s{i}", [i + 1] * 8, tenant="neighbour", max_tokens=100) for i in range(4)]
        for s in streams:
            sched.add(s)
        while any(s.is_prefilling or s.status.value == "waiting" for s in streams):
            engine_step(sched)
        long = prompt(600, scores)
        sched.add(long)
        cost = sched.step_cost.coefficients()

        plan = sched.schedule()

        features = step_features(plan)
        assert features.decode_rows == 4
        assert features.scored_rows == (features.prefill_tokens if scores else 0)
        assert predict(cost, features) <= PLAN_TO * 0.1
        chunks[scores] = features.prefill_tokens
    # Its rows cost 1.8x a plain one's: the same room holds about 1/1.8 as many.
    assert chunks[True] < chunks[False] * 0.6


def test_the_guaranteed_chunk_of_a_scoring_prompt_is_bounded_by_its_scores_too():
    sched = Scheduler(config(max_step_s=0.001, step_cost_prior=dataclasses.replace(COST, per_scored_row_s=0.01)))
    stream = Sequence("s0", [3] * 8, tenant="neighbour", max_tokens=100)
    sched.add(stream)
    while stream.is_prefilling or stream.status.value == "waiting":
        engine_step(sched)
    sched.add(prompt(300, scores=True))

    features = step_features(sched.schedule())

    # A block of 16 plain rows costs 16 ms at a prompt's start: that is all a scored chunk is granted too.
    assert 0 < features.prefill_tokens < 16
    assert predict(COST, StepFeatures(16, 0, 16, attention_pairs(0, 16))) - COST.base_s >= \
        predict(sched.step_cost.coefficients(), StepFeatures(features.prefill_tokens, 0, features.prefill_tokens,
                                                             attention_pairs(0, features.prefill_tokens),
                                                             features.scored_rows)) - COST.base_s


def test_the_cost_model_learns_what_a_scored_row_costs_from_the_engines_steps():
    truth = StepCost(0.02, 6e-4, 2e-4, 3e-6, 0.0, 1.2e-3)
    model = StepCostModel(dataclasses.replace(COST, per_scored_row_s=0.0), memory_steps=200)
    rng = random.Random(5)
    for _ in range(400):
        n = rng.choice([0, 16, 64, 150])
        f = StepFeatures(n, rng.randint(0, 8), rng.randint(10, 4000), 0, n if rng.random() < 0.3 else 0)
        model.observe(f, predict(truth, f))
    scoring = StepFeatures(128, 4, 2000, 0, 128)
    assert model.predict(scoring) == pytest.approx(predict(truth, scoring), rel=0.05)
