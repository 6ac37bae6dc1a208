"""The scheduler's view of one request: its tokens, its KV blocks and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it.

    Tokens ``[0, num_computed_tokens)`` have their keys and values in the KV
    cache, in the blocks of ``block_table`` (block ``i`` holds positions
    ``[i*block_size, (i+1)*block_size)``). The last sampled token is never
    computed until the next step feeds it, so a running sequence always has
    ``num_computed_tokens == num_tokens - 1`` between steps.
    """

    seq_id: str
    prompt_token_ids: list[int]
    tier: str = "standard"
    adapter: str | None = None
    # Opaque to the scheduler: whose request this is, for fair share and the prefix cache's scope.
    tenant: str | None = None
    weight: float = 1.0  # the tenant's share of its tier relative to others (fair share)
    # The request whose n > 1 choices this is one of (opaque): the choices are preempted together.
    group: str | None = None
    # A later choice queued to join its running first choice: admitted before anything else queued.
    joins_group: bool = False
    max_tokens: int = 16
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at first admission (billed as cached).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # After a preemption, tokens below this index are recomputed work; the
    # tier whose request caused the preemption pays for them.
    recompute_until: int = 0
    recompute_charged_tier: str | None = None
    num_preemptions: int = 0
    # The sequence this one gave way to in a fair turn (policy.py): it never takes that one's place back.
    gave_way_to: str | None = None
    # False while the request needs the logits of prompt positions it has not computed yet
    # (prompt logprobs): a prefix-cache hit would skip them.
    reads_prefix_cache: bool = True
    # Time spent in a waiting queue, first wait and waits after preemptions together.
    queue_time_s: float = 0.0
    waiting_since: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def is_long_context(self, after: int | None) -> bool:
        """Whether the model computes this sequence in its long-context regime: it holds more than
        ``after`` tokens (None: the model has one regime). The one rule the scheduler's recompute at
        the crossing, the prefix cache's chain and the model's rotary tables all follow."""
        return after is not None and self.num_tokens > after

    @property
    def has_tokens_left(self) -> bool:
        """Fewer outputs than ``max_tokens``: it may decode; at the limit it waits for the engine's finish()."""
        return len(self.output_token_ids) < self.max_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the one newest token is left to compute."""
        return self.num_uncomputed_tokens > 1
