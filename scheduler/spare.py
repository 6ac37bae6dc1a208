"""Spare-capacity tiers (``TierConfig.spare_only``, the batch tier): when a step may carry their work, and how much.

Their work is planned last in a step, into what the interactive tiers' work left, and only while
no interactive request waits for its first token: none in a queue, no running prompt cut short,
and none whose prompt this step computes. Such a request would wait longer beside spare rows,
which lengthen the step it waits for. A step of interactive decodes grows by at most
``SchedulerConfig.spare_step_share`` of its predicted time for spare rows, and never past the
inter-token bound it has (scheduler/step_budget.py). A step of spare work alone decodes every spare
stream, and its prefill is bounded as a step of streams is, by the tightest interactive bound
(``max_step_s``, the tiers' TPOT SLOs), one block always going in: a request that arrives while it
runs waits for it about as long as for a step of streams.

``plan_spare`` is that last part of ``Scheduler.schedule()``, kept here beside its rules: it runs the
scheduler's step operations (``grow_running``, ``schedule_prefills``) on its state, through
``step_builder.StepPlanner``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections import deque

from scheduler.config import SchedulerConfig, StepCost
from scheduler.plan import StepFeatures
from scheduler.sequence import Sequence
from scheduler.step_budget import PLAN_TO, StepTimeBound
from scheduler.step_builder import StepBuilder, StepPlanner
from scheduler.step_cost import predict


def interactive_waits_for_first_token(
    waiting: Mapping[str, deque[Sequence]],
    step: StepBuilder,
    running: list[Sequence],
    is_spare: Callable[[str], bool],
    queue_of: Callable[[Sequence], str],
) -> bool:
    """Whether a request of a tier that is not spare waits for its first token after ``step``'s interactive
    planning: queued, running with prompt left that the step does not finish, or given a prompt chunk in it."""
    if any(queue and not is_spare(name) for name, queue in waiting.items()):
        return True
    if any(not chunk.is_decode for chunk in step.plan.chunks):
        return True  # only interactive chunks are planned yet
    # A prompt with no chunk in the step (one with a chunk was caught above).
    return any(seq.is_prefilling and not is_spare(queue_of(seq)) for seq in running)


def spare_bound(config: SchedulerConfig, step: StepBuilder, cost: StepCost) -> StepTimeBound | None:
    """The time bound a step's spare work is planned under (None: only the token budget bounds it);
    ``step`` holds the interactive work planned so far (decodes only)."""
    limits = []
    if step.time is not None:
        limits.append(step.time.planned_s)
    if step.plan.chunks:
        limits.append(predict(cost, step.features) * (1 + config.spare_step_share))
    else:
        bounds = [config.max_step_s, *(t.tpot_slo_s for t in config.tiers if not t.spare_only)]
        bounds = [b for b in bounds if b is not None]
        if bounds:
            limits.append(PLAN_TO * min(bounds))
    if not limits:
        return None
    # Beside interactive decodes no guaranteed chunk: spare prefill may wait for a step with room. Alone,
    # a step always advances its prompt, as any bounded step does, or spare work could starve forever
    # on a machine whose every step outlasts the bound.
    return StepTimeBound(min(limits) / PLAN_TO, cost, min_chunk=0 if step.plan.chunks else config.min_chunk)


def decode_features(seq: Sequence) -> StepFeatures:
    """What one decode row of ``seq`` adds to a step."""
    return StepFeatures(0, 1, seq.num_computed_tokens + 1)


def plan_spare(sched: StepPlanner, step: StepBuilder, decodes: list[Sequence]) -> None:
    """The spare-capacity queues' work (their running ``decodes``, then their prefill), into what the step's
    interactive work left."""
    policy = sched.policy
    spare = [q for q in policy.queue_names() if policy.is_spare(q)]
    if not spare or interactive_waits_for_first_token(sched.waiting, step, sched.running, policy.is_spare,
                                                      policy.queue_of):
        return  # spare rows would lengthen a step some interactive request waits for
    beside = bool(step.plan.chunks)  # interactive decodes, whose step spare rows may grow only so much
    step.time = spare_bound(sched.config, step, sched.step_cost.coefficients())
    for seq in decodes:
        if (
            step.tokens_left > 0  # a row may fit the time bound where no prefill token does
            and seq.seq_id not in step.preempted
            and seq.has_tokens_left
            and (not beside or step.time is None or step.time.fits(step.features + decode_features(seq)))
            and sched.grow_running(seq, seq.num_computed_tokens + 1, step)
        ):
            step.add(seq, 1)
    prefilling = sched.prefilling()
    headroom = policy.spare_headroom_blocks()
    for queue in spare:
        sched.schedule_prefills(queue, prefilling[queue], step, 0, True, headroom)
