"""The inter-token latency bound: how many prefill tokens a step may take while sequences decode.

As Sarathi-Serve sizes its chunks to a time-between-tokens SLO: every running stream waits for
the whole step before its next token, so a step that carries a long prompt's chunk of hundreds of
tokens makes every stream's gap that long. Once a step's decodes are planned, its prefill is cut
so that the step's predicted time (scheduler/step_cost.py) stays under a target (planned to
``PLAN_TO`` of it): the tightest of
``SchedulerConfig.max_step_s`` and the ``tpot_slo_s`` of every tier with a sequence decoding in
it. The first ``min_chunk`` prefill tokens of a step are granted whatever the prediction, so the
prompt at the head of the line advances every step and always finishes. A step with nobody
decoding has no bound (its chunks are as large as the token budget allows) unless it makes the first
token of a request whose tier has a TPOT SLO: that client waits for the step as a stream does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.config import SchedulerConfig, StepCost
from scheduler.plan import StepFeatures
from scheduler.sequence import Sequence
from scheduler.step_cost import predict

# A step is planned to this share of its target: the rest is for the fit's error (a few percent
# on a steady machine) and for what a step does beside the work the cost model counts.
PLAN_TO = 0.95


def step_target_s(config: SchedulerConfig, decoding: Iterable[Sequence]) -> float | None:
    """The longest a step may last beside ``decoding`` (the sequences it decodes); None: unbounded."""
    tpot = {t.name: t.tpot_slo_s for t in config.tiers}
    targets = [tpot.get(s.tier) for s in decoding]
    targets.append(config.max_step_s if targets else None)  # no stream decoding: no bound
    bounds = [t for t in targets if t is not None]
    return min(bounds) if bounds else None


def first_token_target_s(config: SchedulerConfig, seq: Sequence) -> float | None:
    """The longest a step that makes ``seq``'s first token may last: its tier's TPOT SLO (None: unbounded).

    Its client waits for the whole step as a stream's does, so with nobody decoding a premium request's
    first step is not made to carry a long prompt's largest chunk; a tier without a TPOT SLO keeps
    today's chunks (``max_step_s`` bounds only the gaps of streams already decoding).
    """
    return next((t.tpot_slo_s for t in config.tiers if t.name == seq.tier), None)


@dataclass(frozen=True)
class StepTimeBound:
    """A step's time target and the cost coefficients it is planned with."""

    target_s: float
    cost: StepCost
    min_chunk: int

    def fits(self, features: StepFeatures) -> bool:
        """Whether a step computing ``features`` is predicted within the target (as planned, ``PLAN_TO`` of it)."""
        return predict(self.cost, features) <= PLAN_TO * self.target_s + 1e-12

    def room(self, features: StepFeatures, start: int | None = None) -> int:
        """Prefill tokens a step computing ``features`` so far may still take in a new chunk beginning at
        position ``start`` (None: leave out the chunk's fixed context cost, for an estimate of what is left)."""
        start = start or 0
        left = PLAN_TO * self.target_s - predict(self.cost, features) - self.cost.per_context_token_s * start
        fits = _largest_chunk(left, self.cost, start)
        granted = self.min_chunk - features.prefill_tokens  # the step's guaranteed progress
        return int(min(max(fits, granted, 0), 1 << 30))


def _largest_chunk(left_s: float, cost: StepCost, start: int) -> float:
    """The most prefill tokens from position ``start`` whose predicted cost fits in ``left_s`` (inf: any).

    n tokens cost ``(per_prefill + per_context) * n + per_pair * (n * start + n * (n + 1) / 2)``
    (scheduler/plan.py's attention pairs): the positive root of that quadratic, floored.
    """
    if left_s < 0:
        return -1
    linear = cost.per_prefill_token_s + cost.per_context_token_s + cost.per_attention_pair_s * (start + 0.5)
    half_pair = cost.per_attention_pair_s / 2
    if half_pair > 0:
        root = (-linear + math.sqrt(linear * linear + 4 * half_pair * left_s)) / (2 * half_pair)
    elif linear > 0:
        root = left_s / linear
    else:
        return math.inf
    # Rounded a little past the floor: a prediction that lands on the target exactly must fit.
    return math.floor(root + 1e-9)


def scaled_share(share_tokens: int, room: int, max_tokens: int) -> int:
    """Tokens kept for worse queues in a step whose prefill room is ``room`` rather than ``max_tokens``:
    the same share of it, so a short room is not all kept (the better queue's prompt must advance too)."""
    if room >= max_tokens:
        return share_tokens
    return math.ceil(share_tokens * room / max_tokens)
