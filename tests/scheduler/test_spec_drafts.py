"""Speculative decoding's bookkeeping: drafts take blocks only as free, rejected positions give them
back, and the prefix cache never holds an unverified token."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import Scheduler, SchedulerConfig, Sequence


def _decoding(config: SchedulerConfig, prompt: list[int], max_tokens: int = 20, tenant: str = "t"):
    """A scheduler with one sequence past its prefill, and that sequence."""
    sched = Scheduler(config)
    seq = Sequence("s", list(prompt), max_tokens=max_tokens, tenant=tenant)
    sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, {"s": 100})
    return sched, seq


@pytest.fixture
def config(small_config) -> SchedulerConfig:
    return dataclasses.replace(small_config, max_model_len=40)


def test_rejected_drafts_give_their_blocks_back_and_accepted_ones_join_the_sequence(config):
    sched, seq = _decoding(config, [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed: 2 blocks of 4
    plan = sched.schedule()
    [chunk] = plan.chunks
    assert sched.add_drafts(plan, chunk, [7, 8, 9, 10, 11]) == 5
    assert chunk.num_tokens == 6 and chunk.token_ids == [100, 7, 8, 9, 10, 11]
    assert len(seq.block_table) == 3  # positions up to 12
    held = sched.num_used_blocks
    sched.update(plan, {"s": 42}, {"s": [7]})
    assert seq.output_token_ids == [100, 7, 42]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 8
    assert len(seq.block_table) == 2 and sched.num_used_blocks == held - 1
    sched.check_invariants()


def test_the_prefix_cache_holds_only_verified_tokens(config):
    sched, seq = _decoding(config, [1, 2, 3, 4, 5, 6])
    plan = sched.schedule()
    [chunk] = plan.chunks
    sched.add_drafts(plan, chunk, [7, 8, 9, 10, 11])  # would fill blocks 1 and 2 if all were kept
    sched.update(plan, {"s": 50}, {"s": []})  # none kept
    assert sched.block_manager.num_cached_blocks == 1  # [1 2 3 4]; [5 6 100 7] was never verified
    plan = sched.schedule()
    sched.update(plan, {"s": 51})
    sched.finish("s")
    # A sequence whose tokens are the rejected drafts' finds no block of them.
    probe = Sequence("p", [1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10], tenant="t")
    assert len(sched.block_manager.match_prefix(probe)) == 1
    sched.check_invariants()


def test_drafts_never_take_the_last_token_of_max_tokens_nor_blocks_that_are_not_free(config):
    sched, seq = _decoding(config, [1, 2, 3, 4, 5, 6], max_tokens=3)
    plan = sched.schedule()
    [chunk] = plan.chunks
    assert sched.add_drafts(plan, chunk, [7, 8, 9]) == 1  # 1 output so far; the step gives at most 2
    sched.update(plan, {"s": 9}, {"s": [7]})
    assert len(seq.output_token_ids) == 3

    sched, seq = _decoding(config, [1, 2, 3, 4, 5, 6])
    sched.add(Sequence("b", list(range(50, 69)), max_tokens=2, tenant="u"))  # 5 blocks: standard's 7 are taken
    plan = sched.schedule()
    chunk = next(c for c in plan.chunks if c.seq is seq)
    assert sched.add_drafts(plan, chunk, [7, 8, 9, 10]) == 1  # only what its own blocks hold: no preemption
    assert {s.seq_id for s in sched.running} == {"s", "b"} and not plan.preempted
    sched.update(plan, {"s": 3, "b": 4}, {"s": []})
    sched.check_invariants()


def test_accepted_tokens_must_be_the_chunks_drafts(config):
    sched, seq = _decoding(config, [1, 2, 3, 4, 5, 6])
    plan = sched.schedule()
    [chunk] = plan.chunks
    sched.add_drafts(plan, chunk, [7, 8])
    with pytest.raises(ValueError, match="not its drafts"):
        sched.update(plan, {"s": 1}, {"s": [8]})
    assert seq.output_token_ids == [100]
    with pytest.raises(ValueError, match="plain decode"):
        sched.add_drafts(plan, chunk, [7])
