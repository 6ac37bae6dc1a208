"""Plain events the step loop emits to its listeners (billing's meter, metrics, tracing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.plan import StepPlan


@dataclass
class StepDrafts:
    """What a step drafted and kept (engine/speculative.py), for the metrics (StepEvent) and the rows' acceptance."""

    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class StepItem:
    request_id: str
    tokens: int  # tokens of this request computed in the step
    # Recomputation after a preemption, or of a sequence that crossed into its model's long-context regime.
    is_recompute: bool
    # The tier whose request caused the preemption (the request's own for a crossing): it pays for recompute.
    recompute_charged_tier: str | None = None
    tier: str = "standard"  # the request's own tier

    @property
    def charged_tier(self) -> str:
        """The tier that pays for these tokens: the preempting tier's for recompute, else the request's."""
        return (self.recompute_charged_tier or self.tier) if self.is_recompute else self.tier


@dataclass(frozen=True)
class StepEvent:
    duration_s: float  # wall time on CPU, CUDA-event time on GPU
    items: tuple[StepItem, ...]
    started_at: float = 0.0  # time.time() at the step's start
    # (request_id, tier) of the sequences this step's plan preempted.
    preempted: tuple[tuple[str, str], ...] = ()
    # Speculative decoding (engine/speculative.py): tokens drafted in the step, and those of them kept.
    # The rejected ones are in the items' tokens: their compute is their request's, as the rest.
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def seconds_by_item(self) -> list[tuple[StepItem, float]]:
        """The step's duration split across its items by their share of its tokens (evenly if none has any)."""
        total = sum(item.tokens for item in self.items)
        if total == 0:
            return [(item, self.duration_s / len(self.items)) for item in self.items]
        return [(item, self.duration_s * item.tokens / total) for item in self.items]


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    status: str  # "ok", "cancelled", "error"
    cached_tokens: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    tier: str = "standard"
    adapter: str | None = None
    queued_at: float = 0.0  # time.time()
    first_token_at: float | None = None
    finished_at: float = 0.0
    queue_s: float = 0.0  # time spent waiting in the scheduler's queue (after preemptions too)


EngineEvent = StepEvent | FinishEvent
Listener = Callable[[EngineEvent], None]


def listener(on_step: Callable[[StepEvent], None] | None = None,
             on_finish: Callable[[FinishEvent], None] | None = None) -> Listener:
    """A listener that hands step events to ``on_step`` and finish events to ``on_finish``."""

    def dispatch(event: EngineEvent) -> None:
        if isinstance(event, StepEvent):
            if on_step is not None:
                on_step(event)
        elif on_finish is not None:
            on_finish(event)

    return dispatch


def step_event(plan: StepPlan, started_at: float, duration_s: float,
               request_id_of: Callable[[str], str] = lambda seq_id: seq_id, drafts: StepDrafts | None = None
               ) -> StepEvent:
    """The event of a step that ran `plan`: each chunk's tokens, recompute apart.

    ``request_id_of`` maps a sequence to its request (the choices of an n > 1 request share one);
    ``drafts``: what the step drafted and kept, if it drafted.
    """
    items: list[StepItem] = []
    for chunk in plan.chunks:
        seq = chunk.seq
        request_id = request_id_of(seq.seq_id)
        recompute = chunk.num_recompute_tokens
        if recompute:
            items.append(StepItem(request_id, recompute, True, seq.recompute_charged_tier, tier=seq.tier))
        if chunk.num_tokens > recompute:
            items.append(StepItem(request_id, chunk.num_tokens - recompute, False, tier=seq.tier))
    preempted = tuple((request_id_of(seq.seq_id), seq.tier) for seq in plan.preempted)
    return StepEvent(duration_s=duration_s, items=tuple(items), started_at=started_at, preempted=preempted,
                     draft_tokens=drafts.drafted if drafts else 0, accepted_tokens=drafts.accepted if drafts else 0)
