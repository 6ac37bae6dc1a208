"""Express admissions: a light tenant's short request does not wait for a long step.

The policy names the requests (``Policy.express``: a tenant's first request while another tenant
of its tier floods it or prefills a long prompt). In ``Scheduler.schedule()`` they start first and
hold the rest of their queue's prefill for that step (``StepBuilder.held``); the scheduler grants
no two such steps in a row. ``Scheduler.schedule_express()`` plans a step of them alone, which the
engine runs between two layers of the step under way, or, with no step under way, before the next
one. Nothing a step under way reads may change then: no running sequence gets a chunk, nobody is
preempted, and a request with an adapter that step does not hold waits (loading it into a slot
could evict one it is reading). Inside a step that holds only worse queues' work, a better queue's
requests go between its layers whatever the policy's rule: a premium request does not wait for a
standard long prompt's step. Inside a step that decodes a stream under a bound, only those better
queues' requests do: that step was planned to its streams' bound (scheduler/step_budget.py), so a
newcomer waits at most about that long for it, as the streams wait for their tokens, while an express
step inside it (and the decode steps of what it started) would delay every one of those streams' next
token by its whole length; the newcomer starts first in the next step instead. An express step is planned
to the running streams' bound (``step_budget.step_target_s``); inside a step that holds none of them it
leaves out ``step_bound_factor``'s tighter share of it (``plan_express_step``).

A request started inside a step under way then decodes inside it too: once its wait for its next
token nears the bound of a step beside it (``step_budget.step_target_s``), ``Scheduler.schedule_express_decodes()``
plans a decode step of the sequences that step does not run, without preempting anyone, which the
engine runs between two layers as it runs an express step. Without it the first token came early and
the second after the rest of the long step: a gap as long as the step the express step was to spare it.

These are parts of ``Scheduler``'s planning kept in their own module: they run its step operations
(``start_sequence``, ``bound``) on its state, through ``step_builder.StepPlanner``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from scheduler.plan import StepPlan
from scheduler.policy import NO_BLOCKS, NO_SLOT
from scheduler.step_budget import PLAN_TO, decodes_alone, outlasts_a_step, step_target_s
from scheduler.step_builder import StepBuilder, StepPlanner

if TYPE_CHECKING:
    from scheduler.sequence import Sequence


def plan_express_step(sched: StepPlanner, step_adapters: frozenset[str] | None,
                      under_way: Collection[str] = ()) -> StepPlan:
    """A step of the policy's express requests alone, each whole; ``step_adapters``: the adapters the step
    under way holds (None: no step is under way), ``under_way``: its sequence ids. Inside a step that
    holds only worse queues' work, a better queue's requests go in order, as many as fit whole: a premium
    request does not wait for a standard long prompt's step."""
    if not any(sched.waiting[queue] for queue in sched.policy.queue_names()):
        return StepPlan()  # asked between every two layer slices: with nobody waiting, plan nothing
    step = StepBuilder(StepPlan(), sched.config.max_num_batched_tokens, sched.policy.charge_prefill)
    # The running streams wait for this step too, inside the step under way or before the next one.
    streams = _streams(sched)
    decoded_inside = any(s.seq_id in under_way for s in streams)
    # Streams decoding between the layers of a step that holds none of them (a long prompt's, planned to the
    # loose bound of a step with nobody decoding) keep their tiers' bounds here, not step_bound_factor's tighter
    # one: under it a newcomer's whole prompt did not fit, and it waited for all of that step instead.
    cost = sched.step_cost.coefficients() if decoded_inside or not under_way else None
    target = step_target_s(sched.config, streams, cost)
    # Whether the step under way decodes one of them under a bound: their next tokens wait for all of it.
    streams_inside = decoded_inside and target is not None
    sched.bound(step, target)
    ahead = _queues_ahead_of(sched, under_way)
    for queue in sched.policy.queue_names():
        if sched.policy.is_spare(queue):
            continue
        if queue in ahead:
            candidates = list(sched.waiting[queue])
        elif streams_inside:
            continue  # it was planned to its streams' bound, and a step between its layers would lengthen their gaps
        else:
            candidates = sched.policy.express(sched.waiting[queue], sched.running, step.budget, outlasts(sched))
        for seq in candidates:
            if queue in ahead and seq.num_tokens > step.budget:
                break  # whole (a preempted one's outputs too, as Policy.express counts) or not at all, in order
            if seq.adapter is not None and step_adapters is not None and seq.adapter not in step_adapters:
                continue
            if sched.start_sequence(seq, step, 0, may_preempt=False) in (NO_SLOT, NO_BLOCKS):
                return step.finished()
    return step.finished()


def _streams(sched: StepPlanner) -> list[Sequence]:
    """The running sequences that decode and whose gaps a bound keeps: not the spare-capacity tiers' (their
    work yields to everyone's)."""
    policy = sched.policy
    return [s for s in sched.running if not s.is_prefilling and not policy.is_spare(policy.queue_of(s))]


def _queues_ahead_of(sched: StepPlanner, under_way: Collection[str]) -> set[str]:
    """The queues that come before every queue with a sequence in the step under way (its ids)."""
    queues = sched.policy.queue_names()
    held = [queues.index(sched.policy.queue_of(s)) for s in sched.running if s.seq_id in under_way]
    return set(queues[:min(held)]) if held else set()


def plan_express_decodes(sched: StepPlanner, under_way: Collection[str], waited_s: float,
                         next_chance_s: float = 0.0) -> StepPlan:
    """A decode step of the running sequences the step under way does not run (``under_way``: its sequence
    ids), once ``waited_s`` since their last token is near the longest a step beside them may last; empty
    before then, or when none does. Nobody is preempted: a sequence whose next block is not free waits.

    "Near" counts what comes after this call: the step under way asks again only ``next_chance_s`` later
    (after its next layer), and the decode step itself takes its predicted time, so waiting for the bound
    itself would give these sequences a gap of the bound, a layer and a decode step."""
    policy = sched.policy
    decoding = [s for s in _streams(sched) if s.seq_id not in under_way and s.has_tokens_left]
    target = step_target_s(sched.config, decoding, sched.step_cost.coefficients())
    if target is None:
        return StepPlan()
    own_s = sched.step_cost.predict(decodes_alone(decoding))
    if waited_s + next_chance_s + own_s < PLAN_TO * target:
        return StepPlan()
    step = StepBuilder(StepPlan(), sched.config.max_num_batched_tokens, policy.charge_prefill)
    for seq in sorted(decoding, key=policy.rank):
        if step.budget > 0 and sched.grow_running(seq, seq.num_computed_tokens + 1, step, may_preempt=False):
            step.add(seq, 1)
    return step.plan


def start_express(sched: StepPlanner, queue: str, step: StepBuilder, keep: int) -> None:
    """Start the policy's express requests of ``queue``; if any, hold its other prefill this step."""
    if not sched.waiting[queue]:
        return  # nobody to start: skip outlasts(), whose cost model refits after every step
    tenants = set()
    for seq in sched.policy.express(sched.waiting[queue], sched.running, step.budget - keep, outlasts(sched)):
        if step.admission_closed:
            break
        if seq.seq_id not in step.preempted and sched.start_sequence(seq, step, keep, True) is None:
            tenants.add(seq.tenant)
    if tenants:
        step.held[queue] = tenants


def outlasts(sched: StepPlanner) -> Callable[[Sequence], bool]:
    """Whether a sequence's next chunk is predicted to take longer than a step may (scheduler/step_budget.py)."""
    return outlasts_a_step(sched.config, sched.step_cost.coefficients())
