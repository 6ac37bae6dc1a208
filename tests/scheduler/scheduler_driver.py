"""The engine's side of the scheduler contract, faked: one deterministic token per sampling chunk."""

from __future__ import annotations

from scheduler import Scheduler, Sequence, StepPlan


def fake_token(seq: Sequence) -> int:
    """Depends only on the tokens so far, like greedy decoding."""
    return (sum(seq.all_token_ids) * 31 + seq.num_tokens) % 1000


def engine_step(sched: Scheduler) -> StepPlan:
    """Schedule, 'run' and apply one step, finishing sequences that reached max_tokens."""
    plan = sched.schedule()
    sched.update(plan, {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples})
    for chunk in plan.chunks:
        if len(chunk.seq.output_token_ids) >= chunk.seq.max_tokens:
            sched.finish(chunk.seq.seq_id)
    return plan
