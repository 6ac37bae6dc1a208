"""What the scheduler refuses up front (a configuration it cannot run, a sequence that could never run),
and the bookkeeping invariants tests check after every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.config import SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from scheduler.block_manager import BlockManager


def check_config(config: SchedulerConfig) -> None:
    """ValueError naming the first setting the scheduler cannot run with."""
    if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1 or config.max_loras < 0:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be positive, max_loras >= 0")
    if not 0 <= config.express_spare_blocks < config.num_blocks:
        raise ValueError("express_spare_blocks must be at least 0 and less than the pool")
    if not 0 <= config.standard_min_share < 1:
        raise ValueError("standard_min_share must be in [0, 1)")
    if sum(t.kv_reserve_fraction for t in config.tiers) >= 1:
        raise ValueError("the tiers' KV reserves must add up to less than the whole pool")
    for name in ("max_step_s", "max_prefill_step_s"):
        if getattr(config, name) is not None and not getattr(config, name) > 0:
            raise ValueError(f"{name} must be positive, not {getattr(config, name)}")
    if config.step_bound_factor is not None and not config.step_bound_factor > 1:
        raise ValueError(f"step_bound_factor must be more than 1, not {config.step_bound_factor}")
    if any(t.tpot_slo_s is not None and not t.tpot_slo_s > 0 for t in config.tiers):
        raise ValueError("a tier's tpot_slo_s must be positive")
    if config.min_chunk < 1:
        raise ValueError("min_prefill_chunk must be at least 1")
    if not 0 <= config.spare_kv_margin < 1 or not 0 <= config.spare_step_share < float("inf"):
        raise ValueError("spare_kv_margin must be in [0, 1) and spare_step_share at least 0")
    if any(t.spare_only and (t.kv_reserve_fraction > 0 or t.ttft_slo_s is not None) for t in config.tiers):
        raise ValueError("a spare-capacity tier can have neither a KV reserve nor a TTFT SLO")
    if config.prefix_cache_scope not in ("tenant", "shared"):
        raise ValueError(f"prefix_cache_scope must be tenant or shared, not {config.prefix_cache_scope!r}")


def check_new_sequence(
    seq: Sequence,
    config: SchedulerConfig,
    max_sequence_tokens: Callable[[str], int],
    blocks_for: Callable[[int], int],
) -> None:
    """ValueError if ``seq`` can never run: unknown tier, empty prompt, too long for the context or for
    its tier's share of the pool (``max_sequence_tokens(tier)``), not fresh, or a bad tenant weight."""
    if seq.tier not in {t.name for t in config.tiers}:
        raise ValueError(f"unknown tier {seq.tier!r}")
    if not seq.prompt_token_ids:
        raise ValueError("the prompt is empty")
    if seq.max_tokens < 1 or seq.num_prompt_tokens + seq.max_tokens > config.max_model_len:
        raise ValueError(
            f"prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.max_tokens}) "
            f"exceeds max_model_len ({config.max_model_len})"
        )
    if seq.num_prompt_tokens + seq.max_tokens > max_sequence_tokens(seq.tier):
        needed = blocks_for(seq.num_prompt_tokens + seq.max_tokens - 1)
        raise ValueError(f"a {seq.tier} sequence of {needed} blocks can never fit its share of the KV pool")
    if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
        raise ValueError("only a fresh waiting sequence can be added")
    if not 0 < seq.weight < float("inf"):
        raise ValueError(f"a tenant's weight must be positive and finite, not {seq.weight!r}")


def check_scheduler_invariants(
    config: SchedulerConfig, block_manager: BlockManager, waiting: list[Sequence], running: list[Sequence],
    live: list[Sequence],
) -> None:
    """AssertionError if the scheduler's bookkeeping is off: its queues, its running batch, every live sequence."""
    block_manager.check_invariants(live)
    assert len(running) <= config.max_num_seqs
    assert len({s.adapter for s in running if s.adapter is not None}) <= config.max_loras
    assert len(waiting) + len(running) == len(live)
    for seq in waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
    for seq in running:
        assert seq.status is SequenceStatus.RUNNING
        assert block_manager.blocks_for(seq.num_computed_tokens) <= len(seq.block_table)
        assert seq.num_computed_tokens < seq.num_tokens <= config.max_model_len
