"""Whether a waiting sequence can start in the step being planned, and whether preempting some frees enough.

Reads only: the scheduler starts the sequence (``Scheduler.start_sequence``) or preempts, as the policy says, from
these answers. A sequence starts with its cached prefix's blocks and its first chunk's, ``spare`` blocks
left free beside them (``whole``: beside its whole prompt's, for spare-capacity work, scheduler/spare.py).
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.policy import NO_ADAPTER, NO_BLOCKS, NO_SLOT
from scheduler.sequence import Sequence
from scheduler.step_builder import StepBuilder


def start_need(config: SchedulerConfig, blocks: BlockManager, running: list[Sequence], seq: Sequence,
               step: StepBuilder, keep: int, spare: int, whole: bool = False) -> tuple[str | None, list[int], int]:
    """(why ``seq`` cannot start now, or None; its cached prefix blocks; its first chunk's tokens)."""
    cached = blocks.match_prefix(seq)
    start = len(cached) * config.block_size
    n = min(seq.num_tokens - start, step.room(seq, start, keep))
    if whole:
        spare += blocks.blocks_for(seq.num_tokens) - blocks.blocks_for(start + n)
    if len(running) >= config.max_num_seqs:
        return NO_SLOT, cached, n
    adapters = {s.adapter for s in running if s.adapter is not None}
    if seq.adapter is not None and seq.adapter not in adapters and len(adapters) >= config.max_loras:
        return NO_ADAPTER, cached, n
    if not blocks.can_allocate(seq, start + n, cached, spare):
        return NO_BLOCKS, cached, n
    return None, cached, n


def frees_enough(config: SchedulerConfig, blocks: BlockManager, seq: Sequence, step: StepBuilder, keep: int,
                 victims: list[Sequence], spare: int, whole: bool = False) -> bool:
    """Whether preempting ``victims`` lets ``seq`` start (their chunks in ``step`` given back to its budget)."""
    cached = blocks.match_prefix(seq)
    tokens = seq.num_tokens if whole else len(cached) * config.block_size + min(
        seq.num_tokens - len(cached) * config.block_size,
        step.budget + sum(step.chunks[v.seq_id].num_tokens for v in victims if v.seq_id in step.chunks) - keep,
    )
    need = blocks.blocks_for(tokens) - len(cached) + sum(1 for b in cached if blocks.ref_count(b) == 0)
    return need + spare <= blocks.num_free_blocks + blocks.reclaimable(victims)
