"""Applying a finished step to its sequences: advance every chunk, append the sampled tokens."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scheduler.block_manager import BlockManager
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence, SequenceStatus


def apply_step(
    plan: StepPlan,
    sampled: Mapping[str, int],
    live: Mapping[str, Sequence],
    block_manager: BlockManager,
    charge_decode: Callable[[Sequence], None],
    long_context_after: int | None,
) -> None:
    """Apply ``plan`` to its chunks' sequences still ``live``; ValueError (and nothing changed) if it is stale."""
    chunks = [(c, c.samples) for c in plan.chunks if live.get(c.seq.seq_id) is c.seq]
    for chunk, samples in chunks:
        if chunk.seq.status is not SequenceStatus.RUNNING or chunk.start != chunk.seq.num_computed_tokens:
            raise ValueError(f"plan is stale for sequence {chunk.seq.seq_id}")
        if samples and chunk.seq.seq_id not in sampled:
            raise ValueError(f"no sampled token for sequence {chunk.seq.seq_id}")
    after = long_context_after
    for chunk, samples in chunks:
        seq = chunk.seq
        seq.num_computed_tokens = chunk.end
        # Before the token is appended: the blocks are registered under the regime that computed them.
        block_manager.register_computed(seq)
        if samples:
            seq.output_token_ids.append(sampled[seq.seq_id])
            charge_decode(seq)
            if after is not None and seq.num_tokens == after + 1:  # tokens come one at a time
                # Its cached keys are the short regime's: it is computed again in the long one, as
                # HF's Phi-3 does, and keeps running (no preemption); it pays its own recompute.
                seq.recompute_until, seq.recompute_charged_tier = seq.num_computed_tokens, seq.tier
                seq.num_computed_tokens = block_manager.restart(seq)
