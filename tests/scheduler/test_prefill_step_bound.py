"""A step with nobody decoding is bounded too (``max_prefill_step_s``), so a request that arrives while it runs, and
decodes between its layers, finds a layer boundary often.

As in test_step_budget.py, the plan is checked against the coefficients the scheduler planned with, never a clock.
"""

from __future__ import annotations

import pytest

from scheduler import Scheduler, Sequence
from scheduler.config import StepCost
from scheduler.step_budget import PLAN_TO, PREFILL_STEP_BASES
from scheduler.step_cost import predict, step_features

from test_step_budget import apply, config, decoding, long_prompt, plan_with_cost, stream, tiers


def test_with_nobody_decoding_a_long_prompts_chunk_is_cut_to_the_prefill_step_bound():
    sched = Scheduler(config(max_step_s=0.1, max_prefill_step_s=0.25))
    sched.add(long_prompt(tokens=2100))

    plan, cost = plan_with_cost(sched)

    features = step_features(plan)
    assert features.decode_rows == 0
    assert 100 < features.prefill_tokens < 512
    assert predict(cost, features) <= PLAN_TO * 0.25


def test_deep_into_a_long_prompt_with_nobody_decoding_every_step_keeps_the_bound_and_the_prompt_finishes():
    sched = Scheduler(config(max_prefill_step_s=0.25))
    prompt = long_prompt(tokens=2100)
    sched.add(prompt)
    steps = 0
    while prompt.is_prefilling or prompt.status.value == "waiting":
        plan, cost = plan_with_cost(sched)
        assert plan.num_tokens >= 1
        assert predict(cost, step_features(plan)) <= PLAN_TO * 0.25 or plan.num_tokens <= sched.config.min_chunk
        apply(sched, plan)
        steps += 1
    assert steps > 2100 / 512 + 1  # more, shorter steps than the token budget alone makes


def test_the_prefill_step_bound_never_cuts_below_its_share_of_the_steps_fixed_cost():
    heavy = StepCost(base_s=0.05, per_prefill_token_s=1e-3, per_decode_seq_s=1e-4, per_context_token_s=1e-6)
    sched = Scheduler(config(max_prefill_step_s=0.1, step_cost_prior=heavy))
    sched.add(long_prompt(tokens=2100))

    plan, cost = plan_with_cost(sched)

    floor = PREFILL_STEP_BASES * cost.base_s
    assert floor > 0.1
    predicted = predict(cost, step_features(plan))
    assert 0.5 * PLAN_TO * floor < predicted <= PLAN_TO * floor


def test_without_a_prefill_step_bound_a_step_with_nobody_decoding_takes_the_whole_token_budget():
    sched = Scheduler(config(max_step_s=0.1))
    sched.add(long_prompt(tokens=2100))

    assert sched.schedule().num_tokens == 512


def test_a_first_token_in_a_step_with_nobody_decoding_tightens_the_prefill_step_bound_to_its_tiers():
    sched = Scheduler(config(max_step_s=0.3, max_prefill_step_s=0.4, tiers=tiers(premium_tpot=0.05)))
    sched.add(long_prompt())
    premium = Sequence("premium-0", list(range(1, 21)), tier="premium", tenant="p", max_tokens=8)
    sched.add(premium)

    plan, cost = plan_with_cost(sched)

    assert (plan.chunks[0].seq, plan.chunks[0].num_tokens) == (premium, 20)
    assert predict(cost, step_features(plan)) <= PLAN_TO * 0.05


def test_beside_decoding_streams_the_tighter_stream_bound_holds_not_the_prefill_step_bound():
    sched = Scheduler(config(max_step_s=0.1, max_prefill_step_s=0.5))
    decoding(sched, stream(0))
    sched.add(long_prompt())

    plan, cost = plan_with_cost(sched)

    assert step_features(plan).decode_rows == 1
    assert predict(cost, step_features(plan)) <= PLAN_TO * 0.1


def test_a_prefill_step_bound_that_is_not_a_duration_is_refused():
    with pytest.raises(ValueError, match="max_prefill_step_s"):
        Scheduler(config(max_prefill_step_s=0.0))


def test_a_step_with_nobody_decoding_is_planned_to_its_whole_target_and_is_not_counted_as_keeping_gaps(monkeypatch):
    """The streams' overrun shortens the steps they wait on; a step nobody streams through is throughput only, and
    its steps must not dilute that overrun either (``StepPlan.bound_s`` is what the cost model counts)."""
    sched = Scheduler(config(max_prefill_step_s=0.25))
    sched.add(long_prompt(tokens=2100))
    monkeypatch.setattr(sched.step_cost, "overrun", lambda: 2.0)  # as stream-bounded steps measured it

    plan, cost = plan_with_cost(sched)

    predicted = predict(cost, step_features(plan))
    assert PLAN_TO * 0.25 * 0.9 < predicted <= PLAN_TO * 0.25  # not halved by the streams' overrun
    assert plan.bound_s is None and plan.bound_slack is None


def test_a_first_tokens_bound_inside_a_step_with_nobody_decoding_keeps_its_gap_and_counts():
    sched = Scheduler(config(max_step_s=0.1, max_prefill_step_s=0.4))
    sched.add(Sequence("short-0", list(range(1, 21)), tier="standard", tenant="s", max_tokens=8))

    plan = sched.schedule()

    assert plan.chunks[0].samples and plan.bound_s == 0.1
