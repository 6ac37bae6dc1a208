"""A model with a long-context regime (Phi-3's LongRoPE, ``long_context_after``): a sequence that
outgrows it is computed again from the start, and the prefix cache never hands a block computed in
one regime to a sequence in the other."""

from __future__ import annotations

import dataclasses

from scheduler import Scheduler, SchedulerConfig
from scheduler.block_manager import BlockManager

AFTER = 10  # sequences of more than 10 tokens are in the long regime


def _config(small_config: SchedulerConfig, **overrides) -> SchedulerConfig:
    return dataclasses.replace(small_config, long_context_after=AFTER, policy="fcfs", **overrides)


def test_the_token_that_crosses_restarts_the_sequence_from_position_zero(small_config, seq, step):
    sched = Scheduler(_config(small_config))
    s = seq(8, max_tokens=6)
    sched.add(s)
    step(sched)  # the prompt: 9 tokens after the first sample
    step(sched)  # a decode: 10 tokens, still short
    assert s.num_tokens == AFTER and s.num_computed_tokens == AFTER - 1 and s.block_table
    step(sched)  # computes token 10, samples token 11: the sequence crosses
    assert s.num_tokens == AFTER + 1
    assert s.num_computed_tokens == 0 and s.block_table == [], "short-regime keys kept past the crossing"
    assert s.recompute_until == AFTER and s.recompute_charged_tier == s.tier
    assert s in sched.running and not any(sched.waiting.values()), "the restart is not a preemption"
    sched.check_invariants()
    plan = step(sched)
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.num_tokens, s.num_tokens) == (0, AFTER + 1, AFTER + 2), "one chunk that samples"
    assert chunk.num_recompute_tokens == AFTER
    assert not plan.preempted
    # From then on it decodes as usual in the long regime.
    (chunk,) = step(sched).chunks
    assert (chunk.start, chunk.num_tokens) == (AFTER + 1, 1)
    sched.check_invariants()


def test_a_prompt_past_the_threshold_starts_long_and_is_never_restarted(small_config, seq, step):
    sched = Scheduler(_config(small_config))
    s = seq(12, max_tokens=4)
    sched.add(s)
    computed = []
    for _ in range(4):
        plan = step(sched)
        computed += [(c.start, c.num_tokens) for c in plan.chunks]
    assert computed == [(0, 12), (12, 1), (13, 1), (14, 1)]


def test_without_a_threshold_nothing_restarts(small_config, seq, step):
    sched = Scheduler(dataclasses.replace(small_config, policy="fcfs"))
    s = seq(8, max_tokens=6)
    sched.add(s)
    starts = [c.start for _ in range(5) for c in step(sched).chunks]
    assert starts == [0, 8, 9, 10, 11]


def test_the_restart_takes_the_long_regimes_cached_prefix(small_config, seq, step):
    sched = Scheduler(_config(small_config))
    shared = list(range(100, 108))  # two full blocks
    long_one = seq(shared + [7, 7, 7, 7], max_tokens=1)  # 12 tokens: long from the start
    sched.add(long_one)
    step(sched)  # computed and cached in the long regime, then finished
    crossing = seq(shared + [5], max_tokens=4)
    sched.add(crossing)
    step(sched)
    assert crossing.num_cached_tokens == 0, "a short sequence hit blocks computed in the long regime"
    step(sched)  # crosses: 11 tokens
    assert crossing.num_computed_tokens == 8, "the restart did not take the long regime's cached blocks"
    (chunk,) = step(sched).chunks
    assert (chunk.start, chunk.num_tokens) == (8, 3)
    sched.check_invariants()


def test_the_same_tokens_in_the_two_regimes_are_different_blocks(seq):
    bm = BlockManager(num_blocks=10, block_size=4, long_context_after=AFTER)
    tokens = list(range(100, 108))
    short, long_ = seq(tokens + [1]), seq(tokens + [1, 2, 3, 4])
    for s in (short, long_):
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = 8
        bm.register_computed(s)
    assert short.block_table[:2] != long_.block_table[:2]
    assert bm.num_cached_blocks == 4
    assert bm.match_prefix(seq(tokens + [9])) == short.block_table[:2]
    assert bm.match_prefix(seq(tokens + [9, 9, 9, 9])) == long_.block_table[:2]
    # No threshold: one regime, so the long sequence would have hit the short one's blocks.
    plain = BlockManager(num_blocks=10, block_size=4)
    first = seq(tokens + [1])
    plain.allocate(first, first.num_tokens)
    first.num_computed_tokens = 8
    plain.register_computed(first)
    assert plain.match_prefix(seq(tokens + [9, 9, 9, 9])) == first.block_table[:2]
