"""Spare-capacity tiers (``TierConfig.spare_only``, the batch tier): when a step may carry their work, and how much.

Their work is planned last in a step, into what the interactive tiers' work left, and only while
no interactive request waits: not in a queue, and no running prompt cut short in this step. A
request that waits would wait longer beside spare rows, which lengthen the step it waits for.
Even then a step that carries interactive work grows by at most ``SchedulerConfig.spare_step_share``
of its predicted time, and never past the inter-token bound that work set
(scheduler/step_budget.py); a step of spare work alone is bounded only by ``max_step_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections import deque

from scheduler.config import SchedulerConfig, StepCost
from scheduler.plan import StepBuilder, StepFeatures
from scheduler.sequence import Sequence
from scheduler.step_budget import PLAN_TO, StepTimeBound, step_target_s
from scheduler.step_cost import predict


def interactive_waits(
    waiting: Mapping[str, deque[Sequence]],
    step: StepBuilder,
    running: list[Sequence],
    is_spare: Callable[[str], bool],
    queue_of: Callable[[Sequence], str],
) -> bool:
    """Whether a request of a tier that is not spare waits after ``step``'s interactive planning: queued,
    or running with prompt left that the step does not finish."""
    if any(queue and not is_spare(name) for name, queue in waiting.items()):
        return True
    for seq in running:
        if seq.is_prefilling and not is_spare(queue_of(seq)):
            chunk = step.chunks.get(seq.seq_id)
            if chunk is None or not chunk.samples:
                return True
    return False


def spare_bound(
    config: SchedulerConfig, step: StepBuilder, cost: StepCost, decodes: list[Sequence]
) -> StepTimeBound | None:
    """The time bound a step's spare work is planned under (None: only the token budget bounds it).

    ``step`` holds the interactive work planned so far; ``decodes`` are the spare sequences decoding.
    """
    limits = []
    if step.time is not None:
        limits.append(PLAN_TO * step.time.target_s)
    if step.plan.chunks:
        limits.append(predict(cost, step.features) * (1 + config.spare_step_share))
    else:
        alone = step_target_s(config, decodes)
        if alone is not None:
            limits.append(PLAN_TO * alone)
    if not limits:
        return None
    # No guaranteed chunk: spare prefill may wait for a step with room.
    return StepTimeBound(min(limits) / PLAN_TO, cost, min_chunk=0)


def decode_features(seq: Sequence) -> StepFeatures:
    """What one decode row of ``seq`` adds to a step."""
    return StepFeatures(0, 1, seq.num_computed_tokens + 1)
