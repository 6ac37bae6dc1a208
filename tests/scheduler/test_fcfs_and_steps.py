"""Step mechanics shared by both policies, and the FCFS baseline."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import Scheduler, SchedulerConfig, SequenceStatus


def fcfs(config: SchedulerConfig, **kw):
    return Scheduler(dataclasses.replace(config, policy="fcfs", **kw))


def test_unknown_policy_is_a_clear_error(small_config):
    with pytest.raises(ValueError, match="policy"):
        Scheduler(dataclasses.replace(small_config, policy="lottery"))


def test_fcfs_serves_in_arrival_order_whatever_the_tier(small_config, seq, step):
    sched = fcfs(small_config, max_num_batched_tokens=8)
    standard, premium = seq(8), seq(8, tier="premium")
    sched.add(standard)
    sched.add(premium)
    assert [c.seq for c in step(sched).chunks] == [standard]


def test_fcfs_has_no_reserve(small_config, seq, step):
    sched = fcfs(small_config)
    for _ in range(3):
        sched.add(seq(12, max_tokens=2))
    step(sched)
    assert sched.kv_usage() == ({"premium": 0, "standard": 9, "batch": 0}, 10)


def test_fcfs_preempts_the_latest_arrival_even_if_premium(small_config, seq, step):
    sched = fcfs(small_config)
    standard = seq(12, max_tokens=4)  # 3 blocks; its first decode needs a 4th
    premium = seq(26, tier="premium", max_tokens=2)  # the other 7 blocks
    sched.add(standard)
    sched.add(premium)
    step(sched)
    plan = step(sched)
    assert plan.preempted == [premium]
    assert premium.recompute_charged_tier == "standard"


def test_fcfs_waiting_request_never_preempts(small_config, seq, step):
    sched = fcfs(small_config)
    sched.add(seq(26, max_tokens=2))
    step(sched)
    sched.add(seq(20, tier="premium", max_tokens=2))
    assert step(sched).preempted == []


@pytest.mark.parametrize("policy", ["fcfs", "tiered"])
def test_decodes_come_before_prefill_chunks(small_config, seq, step, policy):
    sched = Scheduler(dataclasses.replace(small_config, policy=policy))
    first = seq(4, max_tokens=4)
    sched.add(first)
    step(sched)
    second = seq(8, max_tokens=2)
    sched.add(second)
    plan = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 8)]
    assert plan.chunks[0].samples and plan.chunks[1].samples


@pytest.mark.parametrize("policy", ["fcfs", "tiered"])
def test_request_with_one_adapter_too_many_waits_then_runs(small_config, seq, step, policy):
    sched = Scheduler(dataclasses.replace(small_config, policy=policy, max_loras=2))
    a, b, c, a2 = (seq(4, adapter=n, max_tokens=3) for n in ("a", "b", "c", "a"))
    for s in (a, b, c, a2):
        sched.add(s)
    plan = step(sched)
    assert {x.seq.seq_id for x in plan.chunks} == {a.seq_id, b.seq_id, a2.seq_id}
    assert c.status is SequenceStatus.WAITING
    while c.status is SequenceStatus.WAITING:
        step(sched)
    while sched.has_unfinished():
        step(sched)
    assert len(c.output_token_ids) == 3


def test_admission_skips_the_cached_prefix_but_computes_the_last_prompt_token(small_config, seq, step):
    sched = fcfs(small_config)
    prompt = list(range(8))
    sched.add(seq(prompt, max_tokens=1))
    step(sched)
    again = seq(prompt, max_tokens=1)
    sched.add(again)
    plan = step(sched)
    assert (plan.chunks[0].start, plan.chunks[0].num_tokens) == (4, 4)
    assert again.num_cached_tokens == 4
    assert len(again.output_token_ids) == 1  # the chunk reached the last prompt token and sampled


def test_abort_frees_blocks_at_once(small_config, seq, step):
    sched = fcfs(small_config)
    s = seq(12, max_tokens=4)
    sched.add(s)
    step(sched)
    assert sched.num_used_blocks == 3
    assert sched.abort(s.seq_id) is s
    assert s.status is SequenceStatus.ABORTED and sched.num_used_blocks == 0
    assert sched.abort(s.seq_id) is None and not sched.has_unfinished()


def test_aborting_a_waiting_sequence_removes_it_from_its_queue(small_config, seq):
    sched = fcfs(small_config)
    s = seq(4)
    sched.add(s)
    assert sched.abort(s.seq_id) is s and sched.schedule().is_empty


def test_sequence_at_max_tokens_is_not_scheduled_again(small_config, seq):
    sched = fcfs(small_config)
    s = seq(4, max_tokens=1)
    sched.add(s)
    plan = sched.schedule()
    sched.update(plan, {s.seq_id: 5})
    assert sched.schedule().is_empty  # waits for the engine's finish()
    assert sched.finish(s.seq_id) is s and s.status is SequenceStatus.FINISHED


def test_update_missing_a_sampled_token_raises_and_changes_nothing(small_config, seq):
    sched = fcfs(small_config)
    a, b = seq(4), seq(4)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(plan, {a.seq_id: 1})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    sched.update(plan, {a.seq_id: 1, b.seq_id: 2})
    assert a.num_computed_tokens == 4 and b.output_token_ids == [2]


def test_update_skips_a_sequence_aborted_during_the_step(small_config, seq):
    sched = fcfs(small_config)
    a = seq(4)
    sched.add(a)
    plan = sched.schedule()
    sched.abort(a.seq_id)
    sched.update(plan, {})
    assert a.output_token_ids == [] and sched.num_used_blocks == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": 20, "max_tokens": 9}, "max_model_len"),
        ({"prompt": 4, "tier": "gold"}, "unknown tier"),
        ({"prompt": []}, "empty"),
    ],
)
def test_add_rejects_bad_input_with_a_clear_error(small_config, seq, kwargs, message):
    sched = fcfs(small_config)
    prompt = kwargs.pop("prompt")
    with pytest.raises(ValueError, match=message):
        sched.add(seq(prompt, **kwargs))
    assert not sched.has_unfinished()


def test_add_rejects_a_duplicate_id(small_config, seq):
    sched = fcfs(small_config)
    sched.add(seq(4, seq_id="x"))
    with pytest.raises(ValueError, match="already"):
        sched.add(seq(4, seq_id="x"))


def test_add_rejects_a_standard_sequence_larger_than_its_share_of_the_pool(small_config, seq):
    sched = Scheduler(dataclasses.replace(small_config, num_blocks=8, max_model_len=32))
    with pytest.raises(ValueError, match="share"):
        sched.add(seq(24, max_tokens=4))  # 7 blocks > 5 (70% of 8)
    sched.add(seq(24, tier="premium", max_tokens=4))
