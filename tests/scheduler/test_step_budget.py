"""The inter-token latency bound: with streams decoding, a step's prefill is cut to its time target.

The scheduler predicts a step's time from its step cost model (scheduler/step_cost.py); these tests
take the coefficients it plans with (``sched.step_cost.coefficients()`` just before ``schedule()``)
and check the plan against them, never a clock.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan
from scheduler.config import StepCost, TierConfig
from scheduler.plan import ScheduledChunk, attention_pairs
from scheduler import step_cost
from scheduler.step_budget import PLAN_TO, StepTimeBound, step_target_s
from scheduler.step_cost import (OVERRUN_MAX, OVERRUN_MEMORY, OVERRUN_MIN_STEPS, REFIT_STEPS, WARMUP_STEPS, StepCostModel,
                                 StepFeatures, predict, step_features)

from scheduler_driver import engine_step, fake_token

# A CPU-like step: 10 ms, 1 ms a prefill token, 0.1 ms a decode row, 1 us a context position.
COST = StepCost(base_s=0.01, per_prefill_token_s=1e-3, per_decode_seq_s=1e-4, per_context_token_s=1e-6)


def tiers(premium_tpot: float | None = None) -> tuple[TierConfig, ...]:
    return (TierConfig("premium", 0, ttft_slo_s=None, tpot_slo_s=premium_tpot),
            TierConfig("standard", 1, ttft_slo_s=None))


def config(**kw) -> SchedulerConfig:
    base = dict(num_blocks=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096,
                standard_min_share=0.0, step_cost_prior=COST, tiers=tiers())
    return SchedulerConfig(**{**base, **kw})


def stream(n: int, tier: str = "standard", tenant: str = "neighbour", max_tokens: int = 200) -> Sequence:
    return Sequence(f"{tenant}-{n}", [(n * 13 + i) % 900 + 1 for i in range(8)], tier=tier, tenant=tenant,
                    max_tokens=max_tokens)


def long_prompt(n: int = 0, tokens: int = 1987, tier: str = "standard", tenant: str = "long") -> Sequence:
    return Sequence(f"{tenant}-{n}", [(n * 7 + i) % 1000 + 1 for i in range(tokens)], tier=tier, tenant=tenant,
                    max_tokens=4)


def decoding(sched: Scheduler, *streams: Sequence) -> None:
    """Add ``streams`` and step until every one of them decodes."""
    for s in streams:
        sched.add(s)
    while any(s.is_prefilling or s.status.value == "waiting" for s in streams):
        engine_step(sched)


def plan_with_cost(sched: Scheduler) -> tuple[StepPlan, StepCost]:
    cost = sched.step_cost.coefficients()
    return sched.schedule(), cost


def apply(sched: Scheduler, plan: StepPlan) -> None:
    sched.update(plan, {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples})
    for c in plan.chunks:
        if len(c.seq.output_token_ids) >= c.seq.max_tokens:
            sched.finish(c.seq.seq_id)


def test_beside_decoding_streams_a_long_prompt_chunk_fits_the_step_target():
    sched = Scheduler(config(max_step_s=0.1))
    streams = [stream(i) for i in range(4)]
    decoding(sched, *streams)
    sched.add(long_prompt())

    plan, cost = plan_with_cost(sched)

    features = step_features(plan)
    assert features.decode_rows == 4
    # Today's plan would give it the whole token budget left (508 tokens, ~0.5 s of this step).
    assert 32 < features.prefill_tokens < 100
    assert predict(cost, features) <= PLAN_TO * 0.1
    # One more token would not fit: the chunk is as large as the target allows.
    assert predict(cost, one_more_token(plan)) > PLAN_TO * 0.1


def test_beside_decoding_streams_a_step_lasts_at_most_its_factor_times_their_decodes_alone():
    """``step_bound_factor``: whatever the seconds bound, a neighbour's prompt stretches the streams' gaps
    by at most that factor (their decode step alone here: ~10.4 ms, so ~21 ms, far inside 0.15 s)."""
    cheap_prefill = dataclasses.replace(COST, per_prefill_token_s=2e-4)  # a block's worth fits beside them
    sched = Scheduler(config(max_step_s=0.15, step_bound_factor=2.0, step_cost_prior=cheap_prefill))
    streams = [stream(i) for i in range(4)]
    decoding(sched, *streams)
    sched.add(long_prompt())

    plan, cost = plan_with_cost(sched)

    features = step_features(plan)
    alone = predict(cost, StepFeatures(0, 4, sum(s.num_computed_tokens for s in streams)))
    assert features.decode_rows == 4 and features.prefill_tokens > sched.config.min_chunk
    assert predict(cost, features) <= PLAN_TO * 2.0 * alone
    assert predict(cost, one_more_token(plan)) > PLAN_TO * 2.0 * alone
    # The seconds bound alone would have let the chunk grow about fifteen times longer.
    seconds_only = Scheduler(config(max_step_s=0.15, step_cost_prior=cheap_prefill))
    decoding(seconds_only, *(stream(i) for i in range(4)))
    seconds_only.add(long_prompt())
    assert step_features(seconds_only.schedule()).prefill_tokens > 5 * features.prefill_tokens


def test_the_factor_bound_is_the_tighter_of_the_two_and_needs_the_cost_model():
    cfg = config(max_step_s=0.015, step_bound_factor=2.0)
    one = stream(0)
    alone = predict(COST, StepFeatures(0, 1, one.num_computed_tokens + 1))
    assert step_target_s(cfg, [one], COST) == pytest.approx(min(0.015, 2.0 * alone))
    assert step_target_s(config(step_bound_factor=3.0), [one], COST) == pytest.approx(3.0 * alone)
    assert step_target_s(config(step_bound_factor=3.0), [one]) is None  # no cost model given: seconds only
    assert step_target_s(config(step_bound_factor=3.0), [], COST) is None  # nobody decoding: no bound
    with pytest.raises(ValueError, match="step_bound_factor"):
        Scheduler(config(step_bound_factor=1.0))


def one_more_token(plan: StepPlan) -> StepFeatures:
    """The features of ``plan`` with its prefill chunk one token longer."""
    chunk = next(c for c in plan.chunks if not c.is_decode)
    longer = ScheduledChunk(chunk.seq, chunk.start, chunk.num_tokens + 1)
    return step_features(plan) + StepFeatures.of(chunk, -1) + StepFeatures.of(longer)


# The same step with a CPU's attention: each prompt row attends to every position before it.
ATTENTION = dataclasses.replace(COST, per_attention_pair_s=2e-7)


def test_deep_into_a_long_prompt_its_chunks_shrink_with_their_attention():
    """A chunk at position 1,500 reads 1,500 positions per row: it must be smaller to fit the same target."""
    sched = Scheduler(config(max_step_s=0.1, step_cost_prior=ATTENTION))
    decoding(sched, *(stream(i, max_tokens=4000) for i in range(4)))
    prompt = long_prompt(tokens=1987)
    sched.add(prompt)
    chunks = []
    while prompt.num_computed_tokens < prompt.num_prompt_tokens:
        plan, cost = plan_with_cost(sched)
        chunk = next(c for c in plan.chunks if c.seq is prompt)
        chunks.append((chunk.start, chunk.num_tokens))
        features = step_features(plan)
        assert predict(cost, features) <= PLAN_TO * 0.1 or chunk.num_tokens <= 16
        if chunk.num_tokens > 16 and chunk.end < prompt.num_prompt_tokens:
            assert predict(cost, one_more_token(plan)) > PLAN_TO * 0.1  # as large as the target allows
        apply(sched, plan)
    first, last = chunks[0][1], chunks[-2][1]
    assert last < first * 0.8, chunks


def test_attention_pairs_count_each_prompt_row_against_the_positions_before_it():
    seq = long_prompt(tokens=100)
    assert StepFeatures.of(ScheduledChunk(seq, 0, 4)).attention_pairs == 1 + 2 + 3 + 4
    assert StepFeatures.of(ScheduledChunk(seq, 10, 2)).attention_pairs == 11 + 12
    done = long_prompt(tokens=4)
    done.output_token_ids.append(5)
    assert StepFeatures.of(ScheduledChunk(done, 4, 1)).attention_pairs == 0  # a decode: its context is enough


def test_on_a_cpu_where_a_block_costs_most_of_the_bound_the_guaranteed_chunk_is_cut_to_keep_it():
    """An AVX2 Zen 1's costs (calibrated at start): a block of 16 prefill rows costs about what three times the
    streams' decode step does, so granting the block whole made every step beside them ~1.5x its bound (the
    hostile bench's neighbour gap 4.2x beside 1,987-token prompts). The guarantee is half the planned target
    in time: fewer tokens, the step inside its bound, and the prompt still advances every step and finishes."""
    slow_cpu = StepCost(base_s=0.0078, per_prefill_token_s=4.4e-3, per_decode_seq_s=5.2e-3, per_context_token_s=3e-6)
    sched = Scheduler(config(max_step_s=0.15, step_bound_factor=3.0, step_cost_prior=slow_cpu))
    streams = [stream(i, max_tokens=4000) for i in range(3)]
    decoding(sched, *streams)
    prompt = long_prompt(tokens=300)
    sched.add(prompt)

    steps = 0
    while prompt.num_computed_tokens < prompt.num_prompt_tokens:
        before = prompt.num_computed_tokens
        plan, cost = plan_with_cost(sched)
        apply(sched, plan)
        steps += 1
        features = step_features(plan)
        alone = predict(cost, StepFeatures(0, 3, sum(s.num_computed_tokens for s in streams)))
        assert features.decode_rows == 3 and 0 < prompt.num_computed_tokens - before < sched.config.min_chunk
        assert predict(cost, features) <= 3.0 * alone
    assert steps < 300 / 4


def test_recent_overruns_do_not_turn_the_guarantee_back_into_a_whole_block(monkeypatch):
    """The decodes alone fit the target but not the plan that recent overruns shortened: a chunk can still keep
    the bound, so the guarantee stays a share of the plan; granting the whole block there (as where nothing can
    keep it) made the premium neighbour's median gap ~0.1 s beside 1,987-token prompts at a factor of 1.5."""
    slow_cpu = StepCost(base_s=0.0078, per_prefill_token_s=4.4e-3, per_decode_seq_s=5.2e-3, per_context_token_s=3e-6)
    sched = Scheduler(config(max_step_s=0.15, step_bound_factor=1.5, step_cost_prior=slow_cpu))
    decoding(sched, *[stream(i, max_tokens=4000) for i in range(3)])
    sched.add(long_prompt(tokens=300))
    monkeypatch.setattr(sched.step_cost, "overrun", lambda: 2.0)

    features = step_features(sched.schedule())

    assert features.decode_rows == 3 and 0 < features.prefill_tokens < sched.config.min_chunk


def test_the_long_prompt_advances_every_step_and_finishes_even_when_nothing_fits():
    # A target below the decodes' own time: only the guaranteed block of prefill per step.
    sched = Scheduler(config(max_step_s=0.001))
    decoding(sched, *(stream(i, max_tokens=1000) for i in range(3)))
    prompt = long_prompt(tokens=300)
    sched.add(prompt)

    steps = 0
    while prompt.num_computed_tokens < prompt.num_prompt_tokens:
        before = prompt.num_computed_tokens
        plan = engine_step(sched)
        steps += 1
        assert prompt.num_computed_tokens - before == min(16, prompt.num_prompt_tokens - before)
        assert step_features(plan).prefill_tokens == min(16, prompt.num_prompt_tokens - before)
    assert steps == math.ceil(300 / 16)
    assert len(prompt.output_token_ids) == 1


def test_deep_into_a_long_prompt_the_guaranteed_chunk_costs_no_more_than_a_block_at_its_start():
    """The guaranteed block deep into a prompt reads ~1,900 positions a row: a step of it was 0.64 s beside a
    0.1 s target. Its guarantee is now a block's time at a prompt's start, in fewer tokens where it must be."""
    cost = dataclasses.replace(COST, per_attention_pair_s=2e-6)
    sched = Scheduler(config(max_step_s=0.005, step_cost_prior=cost))  # below the decodes' own time
    decoding(sched, *(stream(i, max_tokens=4000) for i in range(3)))
    prompt = long_prompt(tokens=1987)
    sched.add(prompt)
    block_at_start = predict(cost, StepFeatures(16, 0, 16, attention_pairs(0, 16))) - cost.base_s
    sizes = []
    while prompt.num_computed_tokens < prompt.num_prompt_tokens:
        before = prompt.num_computed_tokens
        plan = engine_step(sched)
        chunk = next(c for c in plan.chunks if c.seq is prompt)
        assert chunk.num_tokens >= 1 and prompt.num_computed_tokens > before
        own = StepFeatures.of(chunk)
        assert predict(cost, own) - cost.base_s - cost.per_context_token_s * chunk.start <= block_at_start + 1e-12
        sizes.append(chunk.num_tokens)
    assert sizes[0] == 16 and sizes[-2] < 16  # a block at first, fewer rows deep into the prompt
    assert len(prompt.output_token_ids) == 1


def test_the_minimum_chunk_is_a_setting():
    sched = Scheduler(config(max_step_s=0.001, min_prefill_chunk=40))
    decoding(sched, stream(0))
    sched.add(long_prompt(tokens=300))

    assert step_features(sched.schedule()).prefill_tokens == 40


def test_with_no_stream_decoding_the_chunk_is_as_large_as_today():
    bounded, unbounded = Scheduler(config(max_step_s=0.001)), Scheduler(config())
    for sched in (bounded, unbounded):
        sched.add(long_prompt(0, tokens=2100))  # neither ends in these steps: no first token bounds one
        sched.add(long_prompt(1, tokens=2100, tenant="other"))
    for _ in range(4):  # 4 x 512 tokens of prefill, nobody decoding yet
        a, b = bounded.schedule(), unbounded.schedule()
        assert [(c.seq.seq_id, c.start, c.num_tokens) for c in a.chunks] == \
               [(c.seq.seq_id, c.start, c.num_tokens) for c in b.chunks]
        assert a.num_tokens == 512 and step_features(a).decode_rows == 0
        apply(bounded, a)
        apply(unbounded, b)


@pytest.mark.parametrize("premium_tpot, max_step_s, target", [(None, 0.2, 0.2), (0.05, 0.2, 0.05), (None, None, None)])
def test_with_nobody_decoding_a_premium_first_token_step_is_bounded_like_its_streams(premium_tpot, max_step_s, target):
    sched = Scheduler(config(max_step_s=max_step_s, tiers=tiers(premium_tpot)))
    sched.add(long_prompt())
    premium = Sequence("premium-0", list(range(1, 21)), tier="premium", tenant="p", max_tokens=8)
    sched.add(premium)

    plan, cost = plan_with_cost(sched)

    assert [(c.seq.seq_id, c.num_tokens) for c in plan.chunks][0] == ("premium-0", 20)
    features = step_features(plan)
    if target is None:  # no bound at all: today's chunks
        assert features.prefill_tokens == 512
    else:
        assert 20 < features.prefill_tokens < 250
        assert predict(cost, features) <= PLAN_TO * target


def test_with_nobody_decoding_a_standard_neighbours_first_token_step_carries_no_long_chunk():
    """The hostile bench's long prompt: the neighbour, a standard tenant like its attacker, was admitted before
    the attacker's last chunk continued (fair share) and then waited for all of it in its own first step."""
    sched = Scheduler(config(max_step_s=0.15))
    attacker = long_prompt(tokens=652, tenant="attacker")
    sched.add(attacker)
    engine_step(sched)  # the attacker's first 512 tokens, nobody else there; 140 left, just under 0.15 s alone
    neighbour = stream(0, tenant="neighbour", max_tokens=16)
    sched.add(neighbour)

    plan, cost = plan_with_cost(sched)

    assert plan.chunks[0].seq is neighbour and plan.chunks[0].samples
    assert 0 < next(c.num_tokens for c in plan.chunks if c.seq is attacker) < 140
    assert predict(cost, step_features(plan)) <= PLAN_TO * 0.15


def test_beside_a_long_prompts_last_long_chunk_a_neighbour_goes_between_layers():
    """The last chunk of a 1,987-token prompt is up to a step's tokens at its greatest depth, the longest step of
    all; the neighbour went between layers only while more than a step's tokens were left."""
    sched = Scheduler(config(max_step_s=0.15))
    attacker = long_prompt(tokens=900, tenant="attacker")
    sched.add(attacker)
    engine_step(sched)
    under_way = sched.schedule()  # the last 388 tokens: ~0.4 s predicted
    assert [(c.seq, c.num_tokens) for c in under_way.chunks] == [(attacker, 388)]
    neighbour = stream(0, tenant="neighbour", max_tokens=16)
    sched.add(neighbour)

    assert [c.seq for c in sched.schedule_express(frozenset()).chunks] == [neighbour]


def test_beside_a_short_chunk_of_another_tenant_nobody_goes_between_layers():
    sched = Scheduler(config(max_step_s=0.15))
    other = long_prompt(tokens=560, tenant="other")
    sched.add(other)
    engine_step(sched)
    sched.schedule()  # its last 48 tokens: ~0.06 s predicted, no longer than the neighbour's own step would be
    sched.add(stream(0, tenant="neighbour", max_tokens=16))

    assert sched.schedule_express(frozenset()).is_empty


def test_without_a_target_nothing_changes_beside_decodes():
    sched = Scheduler(config())
    decoding(sched, *(stream(i) for i in range(4)))
    sched.add(long_prompt())

    assert step_features(sched.schedule()).prefill_tokens == 512 - 4


def test_the_tightest_tier_decoding_sets_the_target():
    cfg = config(max_step_s=0.2, tiers=tiers(premium_tpot=0.05))
    premium, standard = stream(0, "premium", "p"), stream(1, "standard", "s")

    assert step_target_s(cfg, []) is None
    assert step_target_s(cfg, [standard]) == 0.2
    assert step_target_s(cfg, [standard, premium]) == 0.05
    assert step_target_s(config(tiers=tiers(premium_tpot=0.05)), [standard]) is None

    rooms = {}
    for who in ("standard", "premium"):
        sched = Scheduler(cfg)
        decoding(sched, stream(0, who, who))
        sched.add(long_prompt())
        plan, cost = plan_with_cost(sched)
        rooms[who] = step_features(plan).prefill_tokens
        assert predict(cost, step_features(plan)) <= (0.05 if who == "premium" else 0.2)
    assert rooms["premium"] < rooms["standard"] < 512


def test_a_premium_long_prompt_still_advances_beside_standard_work_under_a_short_room():
    # Standard's min share is a share of the step's room, not of the token budget: at 10% of 512
    # tokens kept it would take the whole 16-token room every step and premium would never advance.
    sched = Scheduler(config(max_step_s=0.001, standard_min_share=0.1))
    decoding(sched, stream(0, "premium", "p", max_tokens=1000))
    premium, standard = long_prompt(0, 200, "premium", "pl"), long_prompt(1, 200, "standard", "sl")
    sched.add(premium)
    sched.add(standard)
    engine_step(sched)
    for _ in range(5):
        p, s = premium.num_computed_tokens, standard.num_computed_tokens
        engine_step(sched)
        assert premium.num_computed_tokens > p and standard.num_computed_tokens > s


def test_a_light_tenants_express_request_must_fit_the_target_beside_decodes():
    cfg = config(max_step_s=0.05)
    sched = Scheduler(cfg)
    decoding(sched, *(stream(i, tenant="flood") for i in range(4)))
    sched.add(Sequence("light-big", list(range(1, 200)), tenant="light-a", max_tokens=2))
    sched.add(Sequence("light-small", list(range(1, 20)), tenant="light-b", max_tokens=2))

    express = sched.schedule_express(frozenset())

    assert [c.seq.seq_id for c in express.chunks] == ["light-small"]
    assert predict(sched.step_cost.coefficients(), step_features(express)) <= 0.05


@settings(max_examples=60, deadline=None)
@given(
    target=st.sampled_from([0.005, 0.03, 0.08, 0.3]),
    premium_tpot=st.sampled_from([None, 0.02, 0.06]),
    budget=st.sampled_from([64, 256, 512]),
    share=st.sampled_from([0.0, 0.1, 0.3]),
    policy=st.sampled_from(["tiered", "fcfs"]),
    seed=st.integers(0, 10**6),
)
def test_every_step_beside_decodes_fits_its_target_unless_it_is_the_minimum_chunk(
    target, premium_tpot, budget, share, policy, seed
):
    rng = random.Random(seed)
    # The engine's steps follow a cost other than the prior: the plans follow the fit as it moves.
    truth = StepCost(0.02, 2e-3, 3e-4, 2e-6)
    cfg = config(max_step_s=target, max_num_batched_tokens=budget, standard_min_share=share, policy=policy,
                 tiers=tiers(premium_tpot), max_num_seqs=12, num_blocks=400)
    sched = Scheduler(cfg)
    made = 0
    for _ in range(120):
        if rng.random() < 0.3:
            tier = rng.choice(["premium", "standard"])
            size = rng.choice([3, 20, 150, 700])
            sched.add(Sequence(f"r{made}", [rng.randrange(1, 900) for _ in range(size)], tier=tier,
                               tenant=f"t{made % 3}", max_tokens=rng.randint(1, 40)))
            made += 1
        if not sched.has_unfinished():
            continue
        decodes = [s for s in sched.running if not s.is_prefilling and len(s.output_token_ids) < s.max_tokens]
        plan, cost = plan_with_cost(sched)
        features = step_features(plan)
        planned_decodes = [c.seq for c in plan.chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens]
        bound = step_target_s(cfg, decodes)
        if planned_decodes and bound is not None and features.prefill_tokens > cfg.min_chunk:
            assert predict(cost, features) <= bound + 1e-9
        sched.observe_step(predict(truth, features), plan.num_tokens, features.prefill_tokens, plan)
        apply(sched, plan)
        sched.check_invariants()


def test_the_cost_model_learns_a_prefill_chunks_attention_from_the_engines_steps():
    """Deep chunks cost more per token than shallow ones: a fit without the pair term under-predicts them."""
    truth = StepCost(0.02, 6e-4, 2e-4, 3e-6, 3e-7)
    model = StepCostModel(COST, memory_steps=200)
    rng = random.Random(3)
    for _ in range(400):
        start, n = rng.choice([0, 200, 900, 1500, 1900]), rng.choice([0, 16, 64, 150])
        f = StepFeatures(n, rng.randint(0, 8), rng.randint(10, 4000) + start + n, attention_pairs(start, n))
        model.observe(f, predict(truth, f))
    deep = StepFeatures(100, 4, 4000, attention_pairs(1880, 100))
    assert model.predict(deep) == pytest.approx(predict(truth, deep), rel=0.05)


@pytest.mark.parametrize("stall, tolerance", [(1, 0.05), (30, 0.15)])
def test_the_cost_model_learns_the_engines_steps_and_shrugs_off_a_stall(stall, tolerance):
    truth = StepCost(0.02, 2e-3, 3e-4, 2e-6)
    model = StepCostModel(COST, memory_steps=200)
    rng = random.Random(1)
    for i in range(400):
        f = StepFeatures(rng.choice([0, 0, 16, 64, 300]), rng.randint(0, 12), rng.randint(10, 5000))
        model.observe(f, predict(truth, f) * (stall if i == 350 else 1))  # one stall near the end
    for f in (StepFeatures(0, 8, 800), StepFeatures(64, 4, 3000), StepFeatures(300, 12, 5000)):
        assert model.predict(f) == pytest.approx(predict(truth, f), rel=tolerance)


@pytest.mark.parametrize("observed", [5, 16, 37])
def test_the_cost_model_fits_the_same_whether_steps_join_its_sums_one_by_one_or_in_batches(observed, monkeypatch):
    """Observations wait and join the weighted sums a batch at a time (step_cost.FOLD_STEPS): each weighted as if
    added at its step, so the fit after any number of them, a partial batch included, is the one-by-one fit."""
    truth = StepCost(0.02, 2e-3, 3e-4, 2e-6)
    rng = random.Random(observed)
    steps = [StepFeatures(rng.choice([0, 16, 300]), rng.randint(0, 12), rng.randint(10, 5000)) for _ in range(observed)]
    durations = [predict(truth, f) * rng.uniform(0.8, 1.2) for f in steps]

    def fitted() -> StepCost:
        model = StepCostModel(COST, memory_steps=20)
        for f, duration in zip(steps, durations):
            model.observe(f, duration)
        return model.coefficients()

    batched = fitted()
    monkeypatch.setattr(step_cost, "FOLD_STEPS", 1)
    assert batched.as_tuple() == pytest.approx(fitted().as_tuple(), rel=1e-9, abs=1e-15)
    assert batched != COST  # the steps moved the fit, so the comparison can fail


def test_the_cost_model_is_solved_after_each_of_its_first_steps_then_every_refit_steps():
    model = StepCostModel(COST, memory_steps=20)
    step, fits = StepFeatures(16, 4, 800), []
    for i in range(WARMUP_STEPS + 3 * REFIT_STEPS):
        model.observe(step, 0.05 + 0.001 * i)  # each step slower: every solve moves the fit
        fits.append(model.coefficients())
    warmup, after = fits[:WARMUP_STEPS], fits[WARMUP_STEPS:]
    assert all(a != b for a, b in zip(warmup, warmup[1:]))
    changes = [i for i in range(1, len(after)) if after[i] != after[i - 1]]
    assert changes and all(b - a == REFIT_STEPS for a, b in zip(changes, changes[1:]))
    assert len(changes) >= 2


def test_the_cost_model_predicts_from_its_prior_before_any_step():
    model = StepCostModel(COST)
    assert model.coefficients() == COST
    assert model.predict(StepFeatures(100, 2, 500)) == pytest.approx(0.01 + 0.1 + 2e-4 + 5e-4)


@pytest.mark.parametrize("bad", [dict(max_step_s=0.0), dict(min_prefill_chunk=0),
                                 dict(tiers=tiers(premium_tpot=-1.0))])
def test_a_bound_it_cannot_keep_is_refused(bad):
    with pytest.raises(ValueError):
        Scheduler(config(**bad))


def _bounded_plan(predicted_s: float) -> StepPlan:
    return StepPlan([ScheduledChunk(stream(0), 8, 1)], bound_s=0.1, predicted_s=predicted_s)


def test_the_overrun_is_how_far_recent_bounded_steps_ran_past_their_prediction():
    model = StepCostModel(COST)
    for _ in range(OVERRUN_MIN_STEPS - 1):
        model.observe_step(_bounded_plan(0.05), 0.1)
    assert model.overrun() == 1.0  # too few to judge
    for _ in range(OVERRUN_MEMORY - 1):
        model.observe_step(_bounded_plan(0.05), 0.06)
    model.observe_step(_bounded_plan(0.05), 0.15)  # one stall
    assert model.overrun() == pytest.approx(1.2)
    for _ in range(3):  # a few steps of the kind run far past their prediction
        model.observe_step(_bounded_plan(0.05), 0.095)
    assert model.overrun() == pytest.approx(1.9)
    for _ in range(OVERRUN_MEMORY):
        model.observe_step(_bounded_plan(0.05), 0.03)  # faster than predicted: never planned longer
    assert model.overrun() == 1.0
    for _ in range(OVERRUN_MEMORY):
        model.observe_step(_bounded_plan(0.05), 0.5)
    assert model.overrun() == OVERRUN_MAX
    model.observe_step(StepPlan([ScheduledChunk(stream(0), 8, 1)]), 10.0)  # an unbounded step does not count
    assert model.overrun() == OVERRUN_MAX


def test_after_bounded_steps_overran_their_prediction_the_next_is_planned_that_much_shorter(monkeypatch):
    sched = Scheduler(config(max_step_s=0.3))  # room for a chunk well past the guaranteed one
    decoding(sched, *[stream(i) for i in range(4)])
    sched.add(long_prompt())
    monkeypatch.setattr(sched.step_cost, "overrun", lambda: 1.5)  # as the last bounded steps measured it

    plan = sched.schedule()

    assert plan.bound_s == 0.3 and PLAN_TO * 0.3 / 1.5 - 0.002 < plan.predicted_s <= PLAN_TO * 0.3 / 1.5


@pytest.mark.parametrize("per_pair", [0.0, 1e-12, 5e-12, 2e-11, 1e-10, 1e-9])
@pytest.mark.parametrize("tokens", [4, 8, 16, 32])
def test_a_chunk_predicted_at_exactly_the_time_left_fits_whatever_the_attention_term(per_pair, tokens):
    # A small pair term beside the linear one made the quadratic's textbook root cancel to just under the
    # chunk, so a bounded step's guaranteed block came out a token short (the CI run of 2026-11-30).
    cost = StepCost(base_s=0.005, per_prefill_token_s=1.5e-3, per_decode_seq_s=1e-4, per_context_token_s=3e-6,
                    per_attention_pair_s=per_pair)
    bound = StepTimeBound(1e-6, cost, min_chunk=tokens)  # a target no step keeps: the block at a prompt's start
    assert bound.granted(0, overrun_anyway=True) == tokens
    chunk_s = predict(cost, StepFeatures(tokens, 0, tokens, attention_pairs(0, tokens))) - cost.base_s
    planned_to_the_chunk = StepTimeBound((cost.base_s + chunk_s) / PLAN_TO, cost, min_chunk=1)
    assert planned_to_the_chunk.room(StepFeatures(), 0) >= tokens
