"""Express steps inside a step under way: what the engine thread runs between two of its layers.

A light tenant's short request (the policy's ``express``) does not wait for other tenants' work: between two layers
of a step under way the step loop asks the scheduler for an express step (``Scheduler.schedule_express``), runs it
whole, hands out its first token, and then finishes the step under way (then, as their bound nears, decode steps of
the requests it started: ``Scheduler.schedule_express_decodes``). Another such step of new requests comes at most
every ``EXPRESS_AGAIN_AFTER_S`` inside one step, so that step is delayed by one short prefill that often at most,
while a request arriving late in a long step (a long prompt's scores can take a second) does not wait for all of it.

``StepUnderWay`` is the step loop's record of the step under way; ``plan_between_layers`` picks what runs at one of
its layer boundaries. Running it, and metering it as a step of its own, stay with the loop (engine/step_loop.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler import Scheduler, StepPlan

# Inside one step under way, an express step of new requests at most this often (the module's docstring).
EXPRESS_AGAIN_AFTER_S = 0.1


@dataclass
class StepUnderWay:
    """What an express step run between its layers must know of the step under way."""

    adapters: frozenset[str]  # an express request may use only these (a slot load could evict one)
    seq_ids: frozenset[str]  # the sequences it runs: a decode step inside it runs only others
    express_s: float | None = None  # the metered seconds of the express steps inside it, once one ran
    express_ended_at: float | None = None  # when the last of them ended (time.monotonic())
    admitted_at: float | None = None  # when the last of them that started new requests began (time.monotonic())
    began_at: float = 0.0  # when the step began (time.monotonic())
    waiting_asked_at: float | None = None  # when the requests already waiting were last asked for (time.monotonic())
    asked_at: float | None = None  # when it last asked between two layers (time.monotonic())
    asked_every_s: float = 0.0  # the time between its last two asks: about when the next one comes

    @classmethod
    def of(cls, plan: StepPlan) -> StepUnderWay:
        """The record of ``plan``'s step, beginning now."""
        return cls(frozenset(c.seq.adapter for c in plan.chunks if c.seq.adapter is not None),
                   frozenset(c.seq.seq_id for c in plan.chunks), began_at=time.monotonic())


def plan_between_layers(under_way: StepUnderWay, scheduler: Scheduler, take_arrivals: Callable[[], bool],
                        may_admit: bool = True) -> StepPlan:
    """The express step to run at this layer boundary of ``under_way``, or an empty plan. ``take_arrivals`` adds
    the inbox's new requests and says whether any came; ``may_admit`` False (messages deferred to the step's end
    wait ahead of any arrival) starts no new request."""
    now = time.monotonic()
    if under_way.asked_at is not None:
        under_way.asked_every_s = now - under_way.asked_at
    under_way.asked_at = now
    plan = StepPlan()
    admits = under_way.admitted_at is None or now - under_way.admitted_at >= EXPRESS_AGAIN_AFTER_S
    if admits and may_admit:
        arrived = take_arrivals()
        # A request already waiting (it came with the long request, the plan had no room for it, or it did not
        # qualify when it arrived: a stream between these layers, say, has since ended) is asked for again
        # every EXPRESS_AGAIN_AFTER_S of a long step.
        due = now - (under_way.waiting_asked_at or under_way.began_at) >= EXPRESS_AGAIN_AFTER_S
        if arrived or due:
            if due:
                under_way.waiting_asked_at = now
            plan = scheduler.schedule_express(under_way.adapters, under_way.seq_ids)
            if not plan.is_empty:
                under_way.admitted_at = now
    if plan.is_empty and under_way.express_ended_at is not None:  # started ones' next tokens, as their bound nears
        plan = scheduler.schedule_express_decodes(under_way.seq_ids, now - under_way.express_ended_at,
                                                  under_way.asked_every_s)
    return plan
