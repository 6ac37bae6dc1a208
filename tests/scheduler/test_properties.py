"""Hypothesis drives the real scheduler through random arrivals, aborts, finishes and adapter mixes.

After every step: block books balance (free or owned, shared with the right
reference count), standard stays out of the reserve, no premium is preempted
while a standard holds blocks, the step respects its budget, batch and adapter
limits, and running decodes are never skipped. At the end every request is
finished or aborted and every block is free.
"""

from __future__ import annotations

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus

from scheduler_driver import fake_token

BLOCK = 4
PREFIXES = {p: [p * 100 + i for i in range(2 * BLOCK)] for p in (1, 2, 3)}  # shared system prompts

arrival = st.tuples(
    st.just("arrive"),
    st.sampled_from(["premium", "standard"]),
    st.sampled_from([0, 1, 2, 3]),  # 0: no shared prefix
    st.integers(1, 24),
    st.sampled_from([None, None, "a", "b", "c"]),
    st.integers(1, 12),
)
operations = st.lists(
    st.one_of(
        arrival,
        arrival,
        arrival,
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 60)),
        st.tuples(st.just("finish"), st.integers(0, 60)),
    ),
    min_size=10,
    max_size=100,
)
configs = st.builds(
    lambda policy, blocks, seqs, budget, loras, share: SchedulerConfig(
        num_blocks=blocks,
        block_size=BLOCK,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=48,
        max_loras=loras,
        policy=policy,
        standard_min_share=share,
    ),
    st.sampled_from(["tiered", "fcfs"]),
    st.integers(16, 28),  # standard's share must hold the longest request: 11 blocks
    st.integers(1, 8),
    st.integers(6, 24),
    st.integers(1, 3),
    st.sampled_from([0.0, 0.1, 0.3]),
)


def check_step(sched, before_running: list[Sequence], plan) -> None:
    cfg = sched.config
    chunk_seqs = [c.seq for c in plan.chunks]
    assert len({s.seq_id for s in chunk_seqs}) == len(chunk_seqs), "a sequence scheduled twice"
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(chunk_seqs) <= cfg.max_num_seqs
    assert len({s.adapter for s in chunk_seqs if s.adapter is not None}) <= cfg.max_loras
    assert not {s.seq_id for s in plan.preempted} & {s.seq_id for s in chunk_seqs}
    for c in plan.chunks:
        assert c.num_tokens >= 1 and c.start == c.seq.num_computed_tokens
        assert c.end <= c.seq.num_tokens <= cfg.max_model_len
        assert len(c.seq.block_table) * BLOCK >= c.end
    preempted = {s.seq_id for s in plan.preempted}
    scheduled = {s.seq_id for s in chunk_seqs}
    for s in before_running:
        if not s.is_prefilling and len(s.output_token_ids) < s.max_tokens:
            assert s.seq_id in scheduled | preempted, "a running decode was skipped"
    if cfg.policy == "tiered" and any(s.tier == "premium" for s in plan.preempted):
        held_before = {s.seq_id for s in before_running if s.tier == "standard"}
        assert held_before <= preempted, "premium preempted while a standard held blocks"
        assert not any(s.block_table for s in sched.running if s.tier == "standard")
    sched.check_invariants()


def run_step(sched) -> None:
    before = list(sched.running)
    plan = sched.schedule()
    check_step(sched, before, plan)
    for s in plan.preempted:
        event(f"{sched.config.policy}: {s.tier} preempted")
    sched.update(plan, {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples})
    for c in plan.chunks:
        if len(c.seq.output_token_ids) >= c.seq.max_tokens:
            assert sched.finish(c.seq.seq_id) is c.seq
    sched.check_invariants()


@settings(max_examples=100, deadline=None)
@given(config=configs, burst=st.lists(arrival, min_size=8, max_size=30), ops=operations)
# Found by hypothesis: a premium preempted itself while its queue had no token
# room left, and standard's min share then admitted a standard into the blocks.
@example(
    config=SchedulerConfig(num_blocks=17, block_size=BLOCK, max_num_seqs=3, max_num_batched_tokens=11,
                           max_model_len=48, max_loras=1, policy="tiered", standard_min_share=0.3),
    burst=[("arrive", "premium", 0, 1, None, 1), ("arrive", "premium", 2, 10, None, 3),
           ("arrive", "premium", 1, 20, None, 5), ("arrive", "premium", 0, 11, "b", 1),
           ("arrive", "premium", 0, 1, None, 1), ("arrive", "premium", 2, 19, None, 3)]
    + [("arrive", "premium", 0, 1, None, 1)] * 4 + [("arrive", "standard", 1, 16, "a", 3)],
    ops=[("step",), ("arrive", "standard", 0, 1, "b", 1)] + [("step",)] * 5 + [("abort", 0), ("abort", 0), ("abort", 4)],
)
def test_random_traffic_keeps_every_invariant_and_ends_with_all_blocks_free(config, burst, ops):
    sched = Scheduler(config)
    made: list[Sequence] = []
    for op in burst + ops:
        if op[0] == "arrive":
            _, tier, prefix, suffix_len, adapter, max_tokens = op
            n = len(made)
            prompt = PREFIXES.get(prefix, []) + [(n * 37 + i) % 500 for i in range(suffix_len)]
            seq = Sequence(f"r{n}", prompt, tier=tier, adapter=adapter, max_tokens=max_tokens,
                           tenant=f"t{n % 3}")
            sched.add(seq)
            made.append(seq)
        elif op[0] == "step":
            run_step(sched)
        elif op[0] == "abort" and made:
            seq = made[op[1] % len(made)]
            was_live = sched.get(seq.seq_id) is seq
            assert (sched.abort(seq.seq_id) is seq) == was_live
            assert not seq.block_table
            sched.check_invariants()
        elif op[0] == "finish":
            # The engine finishes early only a running sequence that has just sampled (a stop token).
            done = [s for s in sched.running if s.output_token_ids]
            if done:
                assert sched.finish(done[op[1] % len(done)].seq_id) is not None
                sched.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished(), "the scheduler stopped making progress"
    assert all(s.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED) for s in made)
    assert sched.num_used_blocks == 0 and not any(sched.kv_usage()[0].values())
    sched.check_invariants()


@settings(max_examples=60, deadline=None)
@given(config=configs, lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 6)), min_size=4, max_size=12))
def test_preemption_never_changes_what_a_sequence_generates(config, lengths):
    """With tokens that depend only on the context, preempted work resumes with identical output."""
    crowded = Scheduler(config)
    roomy = Scheduler(SchedulerConfig(num_blocks=400, block_size=BLOCK, max_model_len=48, policy=config.policy))
    outputs = []
    for sched in (crowded, roomy):
        seqs = [
            Sequence(f"r{i}", [(i * 13 + j) % 300 for j in range(n)], tier="premium" if i % 3 == 0 else "standard",
                     max_tokens=m)
            for i, (n, m) in enumerate(lengths)
        ]
        for s in seqs:
            sched.add(s)
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            run_step(sched)
        assert not sched.has_unfinished()
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]
