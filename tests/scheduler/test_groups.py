"""The n choices of one request (a group) are preempted together, and their blocks come back exactly once."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus

from scheduler_driver import engine_step

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # two full blocks of 4 and a partial one


def config(**kw) -> SchedulerConfig:
    base = dict(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40,
                standard_min_share=0.0)
    return SchedulerConfig(**{**base, **kw})


def choices(request_id: str, n: int, tier: str = "standard", max_tokens: int = 16) -> list[Sequence]:
    return [Sequence(f"{request_id}#{i}", list(PROMPT), tier=tier, max_tokens=max_tokens, tenant="t",
                     group=request_id) for i in range(n)]


def running_group(sched: Scheduler) -> list[Sequence]:
    group = choices("req", 3)
    sched.add(group[0])
    engine_step(sched)  # the first choice's prompt is computed and cached, as the engine does it
    for sibling in group[1:]:
        sched.add(sibling, sibling_of=group[0].seq_id)
    engine_step(sched)
    assert all(s.status is SequenceStatus.RUNNING for s in group)
    return group


def test_siblings_share_the_prompts_full_blocks():
    sched = Scheduler(config())
    group = running_group(sched)
    shared = set(group[0].block_table[:2])
    assert all(set(s.block_table[:2]) == shared for s in group)
    assert all(sched.block_manager.ref_count(b) == 3 for b in shared)


def test_a_preempted_choice_takes_its_running_siblings_with_it():
    sched = Scheduler(config())
    group = running_group(sched)
    sched.add(Sequence("gold", list(range(100, 124)), tier="premium", max_tokens=2))
    plan = engine_step(sched)
    assert {s.seq_id for s in plan.preempted} == {s.seq_id for s in group}
    assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in group)
    assert all(c.seq.tier == "premium" for c in plan.chunks)
    sched.check_invariants()


def test_a_group_aborted_after_preemption_leaves_no_block_behind():
    sched = Scheduler(config())
    group = running_group(sched)
    sched.add(Sequence("gold", list(range(100, 124)), tier="premium", max_tokens=2))
    engine_step(sched)
    for s in group:
        sched.abort(s.seq_id)
    while sched.has_unfinished():
        engine_step(sched)
    sched.check_invariants()
    assert sched.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.sampled_from(["premium", "standard"]), st.integers(1, 3), st.integers(1, 12),
                                st.booleans()), min_size=1, max_size=30),
    seqs=st.integers(2, 6),
)
def test_no_choice_runs_in_a_step_that_preempted_its_sibling(arrivals, seqs):
    """Random groups, tiers and aborts under a tight pool: a group never straddles a preemption,
    the books balance after every step, and at the end every block is free."""
    sched = Scheduler(config(max_num_seqs=seqs, num_blocks=16, max_num_batched_tokens=16), clock=lambda: 0.0)
    ids = itertools.count()
    pending = list(arrivals)
    live: list[Sequence] = []
    for t in itertools.count():
        if pending:
            tier, n, max_tokens, aborted = pending.pop(0)
            group = choices(f"r{next(ids)}", n, tier, max_tokens)
            for s in group:
                sched.add(s)
            live += group
            if aborted and t % 3 == 0:
                sched.abort(group[-1].seq_id)
        plan = engine_step(sched)
        sched.check_invariants()
        preempted = {s.group for s in plan.preempted}
        assert not any(s.group in preempted for s in sched.running)
        if not pending and not sched.has_unfinished():
            break
        assert t < 2000, "no progress"
    assert sched.num_used_blocks == 0 and all(s.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)
                                              for s in live)


def test_later_choices_join_their_admitted_request_ahead_of_everything_queued():
    """Once the first choice's prompt is computed, its siblings are part of an admitted request: they
    are admitted in the next step, before requests that queued earlier, whatever their tenant's
    fair-share counter (the flood's tenant here has been served nothing yet)."""
    for fair in (True, False):
        sched = Scheduler(config(num_blocks=40, max_num_seqs=6, fair_share=fair))
        group = choices("req", 3)
        sched.add(group[0])
        engine_step(sched)
        for i in range(6):  # another tenant's backlog, queued before the siblings
            sched.add(Sequence(f"other{i}", list(range(30, 42)), max_tokens=8, tenant="flood"))
        for sibling in group[1:]:
            sched.add(sibling, sibling_of=group[0].seq_id)
        engine_step(sched)
        assert all(s.status is SequenceStatus.RUNNING for s in group), f"fair_share={fair}"
        assert not any(s.joins_group for s in group)
        sched.check_invariants()
