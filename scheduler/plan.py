"""What one engine step computes: chunks of sequences' tokens, and who was preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass
class ScheduledChunk:
    """Compute positions ``[start, start + num_tokens)`` of ``seq`` in this step.

    A decode is a chunk of one token; a prefill (or a recompute after
    preemption) is a longer chunk. The block manager has allocated every block
    these positions need before the plan is returned.
    """

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the newest known token, so the step samples the next one."""
        return self.end == self.seq.num_tokens

    @property
    def num_recompute_tokens(self) -> int:
        return max(0, min(self.end, self.seq.recompute_until) - self.start)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences preempted (blocks freed, back to the head of their queue) by this plan.
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
