"""The step under construction (StepBuilder): the plan so far, its token budget and time bound, and what it
has used; and the part of the scheduler that its planning modules (express.py, spare.py) run (StepPlanner)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from scheduler.plan import ScheduledChunk, StepFeatures, StepPlan, scores_prompt
from scheduler.sequence import Sequence
from scheduler.step_budget import StepTimeBound
from scheduler.step_cost import predict

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig
    from scheduler.policy import Policy
    from scheduler.step_cost import StepCostModel


@dataclass
class StepBuilder:
    """The plan under construction and what it has used so far."""

    plan: StepPlan
    tokens_left: int  # of the step's token budget
    # charge(seq, start, num_tokens, sign): the policy's fair-share charge for planned tokens.
    charge: Callable[[Sequence, int, int, int], None]
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    # A better queue's head could not get blocks or a slot: worse queues admit nobody.
    admission_closed: bool = False
    # Queues whose prefill this step is only their express tenants' (the policy's ``express``).
    held: dict[str, set[str | None]] = field(default_factory=dict)
    # The inter-token latency bound, set once the step's decodes are planned (scheduler/step_budget.py).
    time: StepTimeBound | None = None
    room_at_bound: int = 0  # the prefill room the bound left when it was set
    features: StepFeatures = StepFeatures()  # of the plan so far, kept up to date by add and drop

    @property
    def budget(self) -> int:
        """Tokens the step may still take: its token budget, and under a time bound what fits the target."""
        if self.time is None:
            return self.tokens_left
        return min(self.tokens_left, self.time.room(self.features))

    def bound(self, time: StepTimeBound) -> None:
        """Put the step under ``time``; the first bound also records the prefill room it leaves."""
        first = self.time is None
        self.time = time
        if first:
            self.room_at_bound = self.budget

    def room(self, seq: Sequence, start: int, keep: int = 0) -> int:
        """Tokens a chunk of ``seq`` computing from position ``start`` may take, ``keep`` left for worse queues."""
        if self.time is None:
            return self.tokens_left - keep
        return min(self.tokens_left, self.time.room(self.features, start, scores_prompt(seq))) - keep

    def finished(self) -> StepPlan:
        """The plan, with its time bound and its predicted time, if it has a bound that keeps streams' gaps."""
        if self.time is not None and self.time.keeps_gaps:
            self.plan.bound_s, self.plan.predicted_s = self.time.target_s, predict(self.time.cost, self.features)
        return self.plan

    def add(self, seq: Sequence, num_tokens: int) -> None:
        chunk = self.chunks.get(seq.seq_id)
        if chunk is None:
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, 0)
            self.chunks[seq.seq_id] = chunk
            self.plan.chunks.append(chunk)
        else:
            self.features += StepFeatures.of(chunk, -1)
        self.charge(seq, chunk.end, num_tokens, 1)
        chunk.num_tokens += num_tokens
        self.tokens_left -= num_tokens
        self.features += StepFeatures.of(chunk)

    def drop(self, seq: Sequence) -> None:
        chunk = self.chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self.plan.chunks.remove(chunk)
            self.tokens_left += chunk.num_tokens
            self.charge(seq, chunk.start, chunk.num_tokens, -1)
            self.features += StepFeatures.of(chunk, -1)


class StepPlanner(Protocol):
    """The scheduler's state and step operations that its planning modules (express.py, spare.py) run:
    ``scheduler.Scheduler``, named here so that those modules need not import it."""

    config: SchedulerConfig
    policy: Policy
    step_cost: StepCostModel
    waiting: dict[str, deque[Sequence]]
    running: list[Sequence]

    def prefilling(self) -> dict[str, list[Sequence]]: ...

    def bound(self, step: StepBuilder, target: float | None) -> None: ...

    def schedule_prefills(self, queue: str, prefilling: list[Sequence], step: StepBuilder, keep: int,
                          may_preempt: bool, headroom: int | None = None) -> None: ...

    def start_sequence(self, seq: Sequence, step: StepBuilder, keep: int, may_preempt: bool, spare: int = 0,
                       whole: bool = False) -> str | None: ...

    def grow_running(self, seq: Sequence, num_tokens: int, step: StepBuilder, may_preempt: bool = True) -> bool: ...
