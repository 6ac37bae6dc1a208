"""Plain events the step loop emits: what billing and metrics consume."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepItem:
    request_id: str
    tokens: int  # tokens of this request computed in the step
    is_recompute: bool  # recomputation after a preemption
    # The tier whose request caused the preemption: it pays for recompute.
    recompute_charged_tier: str | None = None


@dataclass(frozen=True)
class StepEvent:
    duration_s: float  # wall time on CPU, CUDA-event time on GPU
    items: tuple[StepItem, ...]
    started_at: float = 0.0  # time.time() at the step's start
    # (request_id, tier) of the sequences this step's plan preempted.
    preempted: tuple[tuple[str, str], ...] = ()


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
    num_preemptions: int = 0
    queue_s: float = 0.0  # time spent waiting in the scheduler's queue (after preemptions too)


def step_event(plan, started_at: float, duration_s: float) -> StepEvent:
    """The event of a step that ran `plan` (a scheduler StepPlan): each chunk's tokens, recompute apart."""
    items: list[StepItem] = []
    for chunk in plan.chunks:
        recompute = chunk.num_recompute_tokens
        if recompute:
            items.append(StepItem(chunk.seq.seq_id, recompute, True, chunk.seq.recompute_charged_tier))
        if chunk.num_tokens > recompute:
            items.append(StepItem(chunk.seq.seq_id, chunk.num_tokens - recompute, False))
    preempted = tuple((seq.seq_id, seq.tier) for seq in plan.preempted)
    return StepEvent(duration_s=duration_s, items=tuple(items), started_at=started_at, preempted=preempted)
