"""The batch tier (issue 32): spare capacity only, first preempted, never in an interactive request's way.

The small pool of the fixtures: 10 blocks of 4 tokens, premium reserves 3, the batch tier's margin is
one more, so a batch sequence starts only if 4 blocks stay free.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus, StepPlan
from scheduler.config import StepCost
from scheduler.step_cost import predict, step_features
from scheduler_driver import fake_token

INTERACTIVE = ("premium", "standard")


def plan_and_check(sched: Scheduler) -> StepPlan:
    """Plan a step and check, before it runs, that its batch work keeps out of interactive work's way."""
    plan = sched.schedule()
    batch_chunks = [c for c in plan.chunks if c.seq.tier == "batch"]
    if batch_chunks:
        assert not any(sched.waiting[t] for t in INTERACTIVE), "a batch row beside a queued interactive request"
        assert all(c.is_decode for c in plan.chunks if c.seq.tier in INTERACTIVE), "a batch row beside a prompt"
        chunks = {c.seq.seq_id: c for c in plan.chunks}
        for seq in sched.running:
            if seq.tier in INTERACTIVE and seq.is_prefilling:
                assert seq.seq_id in chunks and chunks[seq.seq_id].samples, "a batch row beside a cut prompt"
    if any(s.tier in INTERACTIVE for s in plan.preempted):
        assert not any(s.tier == "batch" for s in sched.running), "interactive preempted while batch runs"
    return plan


def run_step(sched: Scheduler) -> StepPlan:
    plan = plan_and_check(sched)
    sched.update(plan, {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples})
    for chunk in plan.chunks:
        if len(chunk.seq.output_token_ids) >= chunk.seq.max_tokens:
            sched.finish(chunk.seq.seq_id)
    sched.check_invariants()
    return plan


def drain(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not sched.has_unfinished():
            assert sched.num_used_blocks == 0
            return
        run_step(sched)
    raise AssertionError("the scheduler did not drain")


def tiers_of(plan: StepPlan) -> set[str]:
    return {c.seq.tier for c in plan.chunks}


def test_a_batch_sequence_gets_no_step_while_an_interactive_prompt_is_still_prefilling(small_config, seq):
    sched = Scheduler(dataclasses.replace(small_config, max_num_batched_tokens=8))
    standard, batch = seq(20, max_tokens=2), seq(4, tier="batch", max_tokens=2)
    sched.add(batch)
    sched.add(standard)
    assert tiers_of(run_step(sched)) == {"standard"}
    assert tiers_of(run_step(sched)) == {"standard"}
    assert batch.status is SequenceStatus.WAITING
    drain(sched)


def test_an_idle_engine_runs_batch_work_to_the_end(small_config, seq):
    sched = Scheduler(small_config)
    batch = [seq(8, tier="batch", max_tokens=3, tenant="t") for _ in range(3)]
    for s in batch:
        sched.add(s)
    assert tiers_of(run_step(sched)) == {"batch"}
    drain(sched)
    assert all(len(s.output_token_ids) == 3 for s in batch)


def test_a_batch_sequence_starts_only_with_the_reserve_and_margin_left_free(small_config, seq):
    sched = Scheduler(small_config)
    premium = seq(12, tier="premium", max_tokens=3)
    sched.add(premium)
    run_step(sched)  # premium's prompt: 3 blocks
    batch = seq(16, tier="batch", max_tokens=2)
    sched.add(batch)
    run_step(sched)  # premium grows to 4 blocks; batch's 4 would leave 2 free, under the 4 kept
    assert batch.status is SequenceStatus.WAITING
    drain(sched)
    assert len(batch.output_token_ids) == 2


def test_a_batch_sequence_longer_than_its_headroom_allows_is_refused_up_front(small_config, seq):
    sched = Scheduler(small_config)
    assert sched.max_sequence_tokens("batch") == 6 * 4 + 1  # 10 blocks less 4 kept free
    with pytest.raises(ValueError, match="can never fit"):
        sched.add(seq(20, tier="batch", max_tokens=6))


def test_premium_preempts_a_batch_sequence_before_a_later_standard_one(small_config, seq):
    sched = Scheduler(dataclasses.replace(small_config, max_num_seqs=2))
    batch = seq(4, tier="batch", max_tokens=10)
    sched.add(batch)
    run_step(sched)
    standard = seq(4, max_tokens=10)
    sched.add(standard)
    run_step(sched)
    premium = seq(4, tier="premium", max_tokens=2)
    sched.add(premium)
    plan = run_step(sched)
    assert plan.preempted == [batch]
    assert standard.status is SequenceStatus.RUNNING and premium.status is SequenceStatus.RUNNING
    drain(sched)


def test_standard_preempts_batch_for_blocks_and_the_recompute_is_billed_to_batch(small_config, seq):
    sched = Scheduler(small_config)
    batch = seq(20, tier="batch", max_tokens=5)
    sched.add(batch)
    for _ in range(4):
        run_step(sched)
    assert len(batch.block_table) == 6 and batch.status is SequenceStatus.RUNNING
    standard = seq(8, max_tokens=2)
    sched.add(standard)  # standard and batch together may hold 7 blocks
    plan = run_step(sched)
    assert plan.preempted == [batch]
    assert batch.recompute_charged_tier == "batch"
    drain(sched)


@pytest.mark.parametrize("fair", [True, False])
def test_batch_tenants_take_turns_by_fair_share(small_config, seq, fair):
    sched = Scheduler(dataclasses.replace(small_config, max_num_seqs=2, fair_share=fair))
    flood = [seq(4, tier="batch", tenant="flood", max_tokens=4) for _ in range(6)]
    for s in flood:
        sched.add(s)
    run_step(sched)
    light = seq(4, tier="batch", tenant="light", max_tokens=4)
    sched.add(light)
    started = []
    while sched.has_unfinished():
        run_step(sched)
        started += [s for s in sched.running if s not in started]
    position = started.index(light)
    if fair:
        assert position <= 2  # its turn comes with the first free slot
    else:
        assert position == len(started) - 1  # in arrival order, behind the whole flood


def test_batch_decodes_are_dropped_from_a_step_they_would_lengthen_past_its_share(seq):
    cost = StepCost(base_s=0.01, per_prefill_token_s=6e-4, per_decode_seq_s=2e-3, per_context_token_s=0.0)
    config = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=16, max_model_len=64,
                             step_cost_prior=cost, spare_step_share=0.5)
    sched = Scheduler(config)
    batch = [seq(4, tier="batch", max_tokens=40, tenant="t") for _ in range(8)]
    for s in batch:
        sched.add(s)
    run_step(sched)
    standard = seq(4, max_tokens=20)
    sched.add(standard)
    run_step(sched)  # standard's prompt
    plan = plan_and_check(sched)
    interactive = dataclasses.replace(plan, chunks=[c for c in plan.chunks if c.seq.tier != "batch"])
    rows = [c for c in plan.chunks if c.seq.tier == "batch"]
    assert 0 < len(rows) < len(batch)  # the step decodes standard and as many batch rows as fit
    assert predict(cost, step_features(plan)) <= 1.5 * predict(cost, step_features(interactive)) + 1e-9
    assert all(s.status is SequenceStatus.RUNNING for s in batch)  # dropped from the step, not preempted


def test_a_batch_backlog_does_not_raise_interactive_predicted_ttft(small_config, seq):
    idle = Scheduler(small_config).load()
    sched = Scheduler(small_config)
    for _ in range(20):
        sched.add(seq(20, tier="batch", max_tokens=2))
    load = sched.load()
    assert load["batch"].queue_depth == 20
    for tier in INTERACTIVE:
        assert load[tier].predicted_ttft_s == idle[tier].predicted_ttft_s
        assert load[tier].queue_depth == 0


def test_a_spare_tier_with_a_reserve_or_slo_is_refused(small_config):
    tiers = (*small_config.tiers[:2], dataclasses.replace(small_config.tiers[2], ttft_slo_s=1.0))
    with pytest.raises(ValueError, match="spare-capacity"):
        Scheduler(dataclasses.replace(small_config, tiers=tiers))


arrival = st.tuples(st.just("arrive"), st.sampled_from(["premium", "standard", "batch", "batch"]),
                    st.integers(1, 16), st.integers(1, 8), st.sampled_from(["a", "b"]))
operations = st.lists(st.one_of(arrival, arrival, st.tuples(st.just("step")), st.tuples(st.just("step")),
                                st.tuples(st.just("abort"), st.integers(0, 40))), min_size=5, max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.sampled_from([8, 64]))
def test_random_mixes_keep_batch_out_of_interactive_work_and_leak_no_blocks(ops, budget):
    config = SchedulerConfig(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
                             max_model_len=28, standard_min_share=0.1)
    sched = Scheduler(config)
    made: list[Sequence] = []
    for op in ops:
        if op[0] == "arrive":
            _, tier, prompt, max_tokens, tenant = op
            s = Sequence(f"s{len(made)}", [len(made) * 31 + i for i in range(prompt)], tier=tier,
                         tenant=tenant, max_tokens=max_tokens)
            try:
                sched.add(s)
            except ValueError:
                continue  # too long for its tier's share of the pool
            made.append(s)
        elif op[0] == "step":
            run_step(sched)
        elif made:
            sched.abort(made[op[1] % len(made)].seq_id)
            sched.check_invariants()
    drain(sched)


def test_batch_work_alone_advances_on_a_machine_whose_every_step_outlasts_the_bound(seq):
    slow = StepCost(base_s=0.5, per_prefill_token_s=6e-3, per_decode_seq_s=1e-2, per_context_token_s=1e-4)
    config = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=64, max_step_s=0.15,
                             step_cost_prior=slow)
    sched = Scheduler(config)
    batch = [seq(30, tier="batch", max_tokens=6, tenant="t") for _ in range(4)]
    for s in batch:
        sched.add(s)
    drain(sched, limit=200)
    assert all(len(s.output_token_ids) == 6 for s in batch)


def test_a_request_arriving_in_a_step_of_batch_decodes_goes_whole_between_its_layers(seq):
    # Batch streams keep no gap bound: their rows must not cut the prompt of a request that arrives in their step
    # to what a stream's bound would leave, or it waits for the step's end.
    cost = StepCost(base_s=0.01, per_prefill_token_s=1e-3, per_decode_seq_s=1e-3, per_context_token_s=0.0)
    config = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                             max_model_len=64, step_cost_prior=cost, step_bound_factor=3.0, max_step_s=0.15)
    sched = Scheduler(config)
    for _ in range(4):
        sched.add(seq(4, tier="batch", max_tokens=40, tenant="bulk"))
    run_step(sched)  # their prompts
    under_way = plan_and_check(sched)
    assert tiers_of(under_way) == {"batch"} and all(c.is_decode for c in under_way.chunks)
    standard = seq(48, tenant="light")
    sched.add(standard)
    between = sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks))
    assert [(c.seq.seq_id, c.num_tokens) for c in between.chunks] == [(standard.seq_id, 48)]
