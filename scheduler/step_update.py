"""Applying a finished step to its sequences: advance every chunk, append the sampled (and accepted drafted) tokens."""

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
    accepted: Mapping[str, list[int]] | None = None,
) -> None:
    """Apply ``plan`` to its chunks' sequences still ``live``; ValueError (and nothing changed) if it is stale.

    ``accepted``: for a chunk with drafts (speculative decoding), the leading drafts the step accepted;
    they join the sequence before its sampled token, and the KV blocks taken only for the rejected
    ones go back to the pool. The prefix cache sees only accepted tokens.
    """
    accepted = accepted or {}
    chunks = [(c, c.samples) for c in plan.chunks if live.get(c.seq.seq_id) is c.seq]
    for chunk, samples in chunks:
        if chunk.seq.status is not SequenceStatus.RUNNING or chunk.start != chunk.seq.num_computed_tokens:
            raise ValueError(f"plan is stale for sequence {chunk.seq.seq_id}")
        if samples and chunk.seq.seq_id not in sampled:
            raise ValueError(f"no sampled token for sequence {chunk.seq.seq_id}")
        kept = accepted.get(chunk.seq.seq_id, [])
        if kept and (not samples or kept != chunk.draft_token_ids[:len(kept)]):
            raise ValueError(f"accepted tokens of sequence {chunk.seq.seq_id} are not its drafts")
    after = long_context_after
    for chunk, samples in chunks:
        seq = chunk.seq
        before = seq.num_tokens
        kept = accepted.get(seq.seq_id, [])
        seq.output_token_ids.extend(kept)
        seq.num_computed_tokens = chunk.end - len(chunk.draft_token_ids) + len(kept)
        if chunk.draft_token_ids:
            block_manager.truncate(seq, seq.num_computed_tokens)
        # Before the token is appended: the blocks are registered under the regime that computed them.
        block_manager.register_computed(seq)
        if samples:
            seq.output_token_ids.append(sampled[seq.seq_id])
            for _ in range(len(kept) + 1):  # fair share counts the tokens the step gave, not those it tried
                charge_decode(seq)
            if after is not None and before <= after < seq.num_tokens:
                # Its cached keys are the short regime's: it is computed again in the long one, as
                # HF's Phi-3 does, and keeps running (no preemption); it pays its own recompute.
                seq.recompute_until, seq.recompute_charged_tier = seq.num_computed_tokens, seq.tier
                seq.num_computed_tokens = block_manager.restart(seq)
