"""Speculative decoding's bookkeeping in a planned step: how many of a decode's draft tokens it can also compute.

The engine proposes drafts (engine/speculative.py) after the step is planned; they go into a plain decode
only as far as they fit without taking anything from anybody: free KV blocks, the step's token budget,
the sequence's ``max_tokens`` and the model's context. ``Scheduler.update()`` gives the blocks of the
drafts the model rejects back.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import ScheduledChunk, StepPlan


def fit_drafts(config: SchedulerConfig, blocks: BlockManager, plan: StepPlan, chunk: ScheduledChunk,
               drafts: list[int]) -> int:
    """``chunk``, a decode of ``plan``, also computes the leading ``drafts`` that fit without preempting anybody
    (counting the token sampled after them); how many."""
    seq = chunk.seq
    if not chunk.is_decode or chunk.draft_token_ids or not chunk.samples:
        raise ValueError(f"only a plain decode can carry drafts (sequence {seq.seq_id})")
    n = min(len(drafts), seq.max_tokens - len(seq.output_token_ids) - 1,
            config.max_model_len - seq.num_tokens - 1,
            config.max_num_batched_tokens - plan.num_tokens)
    while n > 0 and not blocks.can_allocate(seq, chunk.end + n):
        n -= 1
    if n <= 0:
        return 0
    blocks.allocate(seq, chunk.end + n)
    chunk.draft_token_ids = list(drafts[:n])
    chunk.num_tokens += n
    return n
