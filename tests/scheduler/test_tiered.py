"""The tiered policy, one test per rule of issue 4 (10 blocks of 4 tokens; standard may hold 7)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import Scheduler, SchedulerConfig


def tiered(config: SchedulerConfig, **kw):
    return Scheduler(dataclasses.replace(config, policy="tiered", **kw))


def queued(sched, tier: str) -> list[str]:
    return [s.seq_id for s in sched.waiting[tier]]


def test_standard_never_holds_blocks_inside_the_premium_reserve(small_config, seq, step):
    sched = tiered(small_config)
    standards = [sched.add(s) or s for s in (seq(12, max_tokens=2), seq(12, max_tokens=2), seq(12, max_tokens=2))]
    plan = step(sched)
    assert {c.seq.seq_id for c in plan.chunks} == {standards[0].seq_id, standards[1].seq_id}
    assert sched.kv_usage() == ({"premium": 0, "standard": 6, "batch": 0}, 10)
    assert queued(sched, "standard") == [standards[2].seq_id]  # 9 blocks would enter the reserve
    sched.check_invariants()


def test_premium_can_use_the_whole_pool(small_config, seq, step):
    sched = tiered(small_config)
    for _ in range(3):
        sched.add(seq(12, tier="premium", max_tokens=2))
    step(sched)
    assert sched.kv_usage() == ({"premium": 9, "standard": 0, "batch": 0}, 10)


def test_premium_goes_before_standard_that_arrived_earlier(small_config, seq, step):
    sched = tiered(small_config, max_num_batched_tokens=8)
    s, p = seq(8), seq(8, tier="premium")
    sched.add(s)
    sched.add(p)
    assert [c.seq for c in step(sched).chunks] == [p]


def test_first_come_first_served_within_a_tier(small_config, seq, step):
    sched = tiered(small_config, max_num_batched_tokens=8)
    first, second = seq(8, tier="premium"), seq(8, tier="premium")
    sched.add(first)
    sched.add(second)
    assert [c.seq for c in step(sched).chunks] == [first]


def test_long_standard_prompt_holds_premium_decodes_for_at_most_one_chunk(small_config, seq, step):
    sched = tiered(small_config, max_num_batched_tokens=8)
    premium = seq(4, tier="premium", max_tokens=8)
    sched.add(premium)
    step(sched)
    long_standard = seq(26, max_tokens=2)
    sched.add(long_standard)
    for chunk_size in (7, 7, 7, 5):
        plan = step(sched)
        assert plan.chunks[0].seq is premium and plan.chunks[0].num_tokens == 1
        assert plan.chunks[1].seq is long_standard and plan.chunks[1].num_tokens == chunk_size


def test_running_premium_needing_a_block_preempts_the_standard_holding_most_blocks(small_config, seq, step):
    sched = tiered(small_config)
    premium = seq(12, tier="premium", max_tokens=4)  # 3 blocks, its first decode needs a 4th
    small, big = seq(6, max_tokens=2), seq(18, max_tokens=2)  # 2 and 5 blocks
    for s in (premium, small, big):
        sched.add(s)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    plan = step(sched)
    assert plan.preempted == [big]
    assert big.recompute_until == 18 and big.recompute_charged_tier == "premium" and big.num_preemptions == 1
    assert {c.seq.seq_id for c in plan.chunks} == {premium.seq_id, small.seq_id}
    sched.check_invariants()


def test_among_standard_victims_with_equal_blocks_the_latest_arrival_goes(small_config, seq, step):
    sched = tiered(small_config)
    premium = seq(16, tier="premium", max_tokens=4)
    earlier, later = seq(10, max_tokens=2), seq(11, max_tokens=2)  # 3 blocks each
    for s in (premium, earlier, later):
        sched.add(s)
    step(sched)
    assert step(sched).preempted == [later]


def test_waiting_premium_short_of_blocks_preempts_running_standard(small_config, seq, step):
    sched = tiered(small_config)
    a, b = seq(10, max_tokens=2), seq(14, max_tokens=2)  # 3 + 4 blocks: standard's whole share
    sched.add(a)
    sched.add(b)
    step(sched)
    premium = seq(20, tier="premium", max_tokens=2)  # 5 blocks, 3 free
    sched.add(premium)
    plan = step(sched)
    assert plan.preempted == [b]
    assert premium in [c.seq for c in plan.chunks]
    sched.check_invariants()


def test_waiting_premium_short_of_batch_slots_preempts_the_latest_standard(small_config, seq, step):
    sched = tiered(small_config, max_num_seqs=2)
    a, b = seq(4, max_tokens=4), seq(4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched)
    premium = seq(4, tier="premium", max_tokens=2)
    sched.add(premium)
    plan = step(sched)
    assert plan.preempted == [b]
    assert {c.seq.seq_id for c in plan.chunks} == {a.seq_id, premium.seq_id}


def test_waiting_premium_short_of_adapter_slots_frees_the_slot_costing_fewest_sequences(
    small_config, seq, step
):
    sched = tiered(small_config)
    x1, y1, x2 = seq(4, adapter="x", max_tokens=4), seq(4, adapter="y", max_tokens=4), seq(4, adapter="x", max_tokens=4)
    for s in (x1, y1, x2):
        sched.add(s)
    step(sched)
    premium = seq(4, tier="premium", adapter="z", max_tokens=2)
    sched.add(premium)
    plan = step(sched)
    assert plan.preempted == [y1]
    assert {c.seq.adapter for c in plan.chunks} == {"x", "z"}


def test_premium_is_never_preempted_for_standard(small_config, seq, step):
    sched = tiered(small_config)
    premium = seq(23, tier="premium", max_tokens=2)  # 6 blocks, its decode fits in them
    standard = seq(16, max_tokens=4)  # 4 blocks; its first decode needs a 5th
    sched.add(premium)
    sched.add(standard)
    step(sched)
    plan = step(sched)
    assert plan.preempted == [standard]
    assert queued(sched, "standard") == [standard.seq_id]
    assert premium.num_preemptions == 0 and len(premium.output_token_ids) == 2


def test_waiting_standard_never_preempts_anyone(small_config, seq, step):
    sched = tiered(small_config)
    first = seq(26, max_tokens=2)  # 7 blocks: standard's whole share
    sched.add(first)
    step(sched)
    sched.add(seq(4, max_tokens=2))
    assert step(sched).preempted == []


def test_among_premium_the_latest_arrival_is_preempted(small_config, seq, step):
    sched = tiered(small_config)
    earlier = seq(16, tier="premium", max_tokens=4)  # 4 blocks, decode needs a 5th
    later = seq(23, tier="premium", max_tokens=2)  # 6 blocks, decodes inside them: the pool is full
    sched.add(earlier)
    sched.add(later)
    step(sched)
    assert step(sched).preempted == [later]


def test_preempted_sequence_resumes_first_in_its_tier_queue(small_config, seq, step):
    sched = tiered(small_config)
    premium = seq(12, tier="premium", max_tokens=4)
    small, big = seq(6, max_tokens=2), seq(18, max_tokens=2)
    for s in (premium, small, big):
        sched.add(s)
    step(sched)
    newcomer = seq(4, max_tokens=2)
    sched.add(newcomer)
    step(sched)  # big is preempted
    assert queued(sched, "standard")[0] == big.seq_id
    while big.num_computed_tokens == 0 or big in sched.waiting["standard"]:
        plan = step(sched)
    resumed = next(c for c in plan.chunks if c.seq is big)
    # Its 4 full blocks were still in the prefix cache: only positions 16-17 are
    # recomputed, and 18 (the token it had sampled) is new work.
    assert (resumed.start, resumed.num_tokens, resumed.num_recompute_tokens) == (16, 3, 2)


def test_standard_keeps_its_min_share_under_sustained_premium_load(small_config, seq, step):
    sched = tiered(small_config, max_num_batched_tokens=16, standard_min_share=0.25, num_blocks=40)
    for _ in range(6):
        sched.add(seq(24, tier="premium", max_tokens=2))
    standard = seq(24, max_tokens=2)
    sched.add(standard)
    for _ in range(3):
        plan = step(sched)
        given = sum(c.num_tokens for c in plan.chunks if c.seq.tier == "standard")
        assert given >= 4
        assert plan.num_tokens == 16


def test_premium_takes_the_whole_budget_when_standard_has_no_work(small_config, seq, step):
    sched = tiered(small_config, max_num_batched_tokens=16, standard_min_share=0.25, num_blocks=40)
    sched.add(seq(24, tier="premium", max_tokens=2))
    assert step(sched).chunks[0].num_tokens == 16


def test_load_predicts_ttft_from_the_queue_ahead_of_each_tier(small_config, seq):
    sched = tiered(small_config, prior_prompt_tokens=100, prior_prefill_tokens_per_s=1000.0, prior_step_time_s=0.1)
    before = sched.load()
    assert before["premium"].predicted_ttft_s == pytest.approx(100 / 1000 + 0.1)
    sched.add(seq(20, tier="premium", max_tokens=2))
    sched.add(seq(24, max_tokens=2))
    load = sched.load()
    assert load["premium"].queue_depth == 1 and load["premium"].running == 0
    # Premium waits only behind premium; standard behind both.
    assert load["standard"].predicted_ttft_s - load["premium"].predicted_ttft_s > 24 / 1000 - 1e-9
    premium_prompt = sched.load_estimator.typical_prompt("premium")
    assert load["premium"].predicted_ttft_s == pytest.approx((20 + premium_prompt) / 1000 + 0.1)


def test_observed_steps_move_the_predicted_ttft(small_config):
    sched = tiered(small_config, prior_prefill_tokens_per_s=1000.0, prior_step_time_s=0.1, load_ema_alpha=1.0)
    sched.observe_step(0.2, 500, 400)  # 2000 prefill tokens/s
    assert sched.load_estimator.prefill_tokens_per_s == pytest.approx(2000.0)
    assert sched.load_estimator.step_time_s == pytest.approx(0.2)
    with pytest.raises(ValueError):
        sched.observe_step(0.1, 10, 20)
