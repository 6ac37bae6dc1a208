"""What one engine step computes: chunks of sequences' tokens, who was preempted, and what that costs (StepFeatures)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass
class ScheduledChunk:
    """Compute positions ``[start, start + num_tokens)`` of ``seq`` in this step.

    A decode is a chunk of one token; a prefill (or a recompute after
    preemption) is a longer chunk. The block manager has allocated every block
    these positions need before the plan is returned.

    A decode may carry ``draft_token_ids`` (speculative decoding, engine/speculative.py): guesses
    of the tokens after the newest one, computed in the same chunk (``num_tokens`` counts them) so
    that the step verifies them all; they are not the sequence's tokens until ``update`` accepts them.
    """

    seq: Sequence
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the newest known token, so the step samples the next one (and one after
        each draft)."""
        return self.end - len(self.draft_token_ids) == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens the chunk computes: the sequence's, then its drafts."""
        if not self.draft_token_ids:
            return self.seq.all_token_ids[self.start:self.end]
        return self.seq.all_token_ids[self.start:] + self.draft_token_ids

    @property
    def num_recompute_tokens(self) -> int:
        return max(0, min(self.end, self.seq.recompute_until) - self.start)

    @property
    def is_decode(self) -> bool:
        """One token of a sequence past its prompt (reads only positions: true before and after ``update``)."""
        return self.num_tokens - len(self.draft_token_ids) == 1 and self.start >= self.seq.num_prompt_tokens


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, as the step cost model (scheduler/step_cost.py) weighs it."""

    prefill_tokens: int = 0  # tokens of chunks that are not decodes (prompts, recompute)
    decode_rows: int = 0
    context_tokens: int = 0  # KV positions the chunks reach, summed over chunks (each chunk's end)
    attention_pairs: int = 0  # (row, position) pairs a prefill chunk's rows attend over, summed over chunks
    scored_rows: int = 0  # prompt rows whose logits the step computes for prompt logprobs (``scored_rows``)

    @staticmethod
    def of(chunk: ScheduledChunk, sign: int = 1) -> StepFeatures:
        if chunk.is_decode:  # a draft verified costs as a prompt token does, its attention as a chunk's
            drafts = len(chunk.draft_token_ids)
            return StepFeatures(sign * drafts, sign, sign * chunk.end,
                                sign * attention_pairs(chunk.end - drafts, drafts) if drafts else 0)
        return StepFeatures(sign * chunk.num_tokens, 0, sign * chunk.end,
                            sign * attention_pairs(chunk.start, chunk.num_tokens),
                            sign * scored_rows(chunk.seq, chunk.start, chunk.num_tokens))

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(self.prefill_tokens + other.prefill_tokens, self.decode_rows + other.decode_rows,
                            self.context_tokens + other.context_tokens, self.attention_pairs + other.attention_pairs,
                            self.scored_rows + other.scored_rows)

    def row(self) -> tuple[float, float, float, float, float, float]:
        return (1.0, float(self.prefill_tokens), float(self.decode_rows), float(self.context_tokens),
                float(self.attention_pairs), float(self.scored_rows))


def attention_pairs(start: int, num_tokens: int) -> int:
    """Causal attention of positions ``[start, start + num_tokens)``: row i attends to positions 0..i."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def scores_prompt(seq: Sequence) -> bool:
    """Whether ``seq``'s prefill rows are scored (prompt logprobs): it reads no prefix cache until they all are."""
    return not seq.reads_prefix_cache


def scored_rows(seq: Sequence, start: int, num_tokens: int) -> int:
    """Rows of positions ``[start, start + num_tokens)`` that engine/prompt_scoring.py puts through the LM head.

    Row ``p`` predicts prompt token ``p + 1``, so the last prompt row scores nothing; rows recomputed after
    a preemption (below ``recompute_until``) were scored before and are not scored again.
    """
    if not scores_prompt(seq):
        return 0
    first = max(start, seq.recompute_until)
    return max(0, min(start + num_tokens, seq.num_prompt_tokens - 1) - first)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences preempted (blocks freed, back to the head of their queue) by this plan.
    preempted: list[Sequence] = field(default_factory=list)
    # Under an inter-token latency bound (scheduler/step_budget.py): the bound, and the step's predicted time
    # as planned. None: no bound.
    bound_s: float | None = None
    predicted_s: float = 0.0

    @property
    def bound_slack(self) -> float | None:
        """How many times its predicted time the step may take and still end within its bound (None: no bound)."""
        return None if self.bound_s is None else self.bound_s / max(self.predicted_s, 1e-9)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
