"""The inter-token latency bound: how many prefill tokens a step may take while sequences decode.

As Sarathi-Serve sizes its chunks to a time-between-tokens SLO: every running stream waits for
the whole step before its next token, so a step that carries a long prompt's chunk of hundreds of
tokens makes every stream's gap that long. Once a step's decodes are planned, its prefill is cut
so that the step's predicted time (scheduler/step_cost.py) stays under a target (planned to
``PLAN_TO`` of it, and shorter by as much as recent bounded steps overran their prediction): the tightest of
``SchedulerConfig.max_step_s`` and the ``tpot_slo_s`` of every tier with a sequence decoding in
it, and ``step_bound_factor`` times the predicted time of a step of its decodes alone. The first
``min_chunk`` prefill tokens of a step are granted whatever the prediction (fewer, down to one, where
they would cost over half the target: deep into a long prompt, or on a slow CPU: ``StepTimeBound.granted``),
so the prompt at the head of the line advances every step and always finishes. A step with nobody
decoding is bounded by ``max_prefill_step_s`` (``prefill_step_target_s``), a looser bound: a request
that arrives while it runs starts and decodes between its layers (scheduler/express.py), so a layer
of a long prompt's largest chunk deep into its context would be that request's gap. A step that makes
the first token of an interactive request is held to that request's tier's bound: its client waits for
the step as a stream does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.config import SchedulerConfig, StepCost
from scheduler.plan import StepFeatures, attention_pairs, scored_rows
from scheduler.sequence import Sequence
from scheduler.step_cost import predict

# A step is planned to this share of its target: the rest is for the fit's error (a few percent
# on a steady machine) and for what a step does beside the work the cost model counts.
PLAN_TO = 0.95
# The guaranteed chunk is shrunk where it would cost more than this share of the target on its own: beside
# decodes that take the rest, such a step stays within about the target.
GRANTED_SHARE = 0.5
# A step with nobody decoding is never cut below this many times the step's fixed cost (the weights' read):
# cutting a long prompt into more chunks then costs its prefill at most about 1/PREFILL_STEP_BASES more.
PREFILL_STEP_BASES = 20


def step_target_s(config: SchedulerConfig, decoding: Iterable[Sequence],
                  cost: StepCost | None = None) -> float | None:
    """The longest a step may last beside ``decoding`` (the sequences it decodes); None: unbounded.
    With ``cost`` (the step cost model's coefficients), ``step_bound_factor`` times their decode step alone too."""
    decoding = list(decoding)
    if not decoding:
        return None  # no stream decoding: no bound
    tpot = {t.name: t.tpot_slo_s for t in config.tiers}
    bounds = [b for b in [config.max_step_s, *(tpot.get(s.tier) for s in decoding)] if b is not None]
    if config.step_bound_factor is not None and cost is not None:
        bounds.append(config.step_bound_factor * predict(cost, decodes_alone(decoding)))
    return min(bounds) if bounds else None


def prefill_step_target_s(config: SchedulerConfig, cost: StepCost) -> float | None:
    """The longest a step with no stream decoding may last: ``max_prefill_step_s``, and at least
    ``PREFILL_STEP_BASES`` times its fixed cost, so a large model's prompts are not cut to chunks whose
    weight reads cost more than their rows (None: no bound, only the token budget)."""
    if config.max_prefill_step_s is None:
        return None
    return max(config.max_prefill_step_s, PREFILL_STEP_BASES * cost.base_s)


def decodes_alone(decoding: list[Sequence]) -> StepFeatures:
    """The features of a step that decodes ``decoding``, one token each, and nothing else."""
    return StepFeatures(0, len(decoding), sum(s.num_computed_tokens + 1 for s in decoding))


def first_token_target_s(config: SchedulerConfig, seq: Sequence) -> float | None:
    """The longest a step that makes ``seq``'s first token may last: the tighter of its tier's TPOT SLO and
    ``max_step_s``, as for a stream of its tier (None: unbounded; a spare-capacity tier's never is).

    Its client waits for the whole step as a stream's does, so with nobody decoding a neighbour's short
    request is not made to share its step with another tenant's long prompt's largest chunk: its first
    token is the first of its gaps.
    """
    tier = next((t for t in config.tiers if t.name == seq.tier), None)
    if tier is None or tier.spare_only:
        return None
    bounds = [b for b in (tier.tpot_slo_s, config.max_step_s) if b is not None]
    return min(bounds) if bounds else None


def outlasts_a_step(config: SchedulerConfig, cost: StepCost) -> Callable[[Sequence], bool]:
    """Whether a running prefill's next chunk, with nobody decoding, makes a long step: more than a step's
    token budget is left, or what is left is predicted to take longer than ``max_step_s`` (its rows' prompt
    scores included: a scored row puts the LM head over the whole vocabulary, many times a plain row's cost).

    Beside such a chunk a neighbour's short request would wait for all of it (the policy's ``express``).
    Its last chunk is often the dearest: up to a whole step's tokens at the prompt's greatest depth.
    """
    def outlasts(seq: Sequence) -> bool:
        start, left = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        if left > config.max_num_batched_tokens:
            return True
        if config.max_step_s is None:
            return False
        return _chunk_cost(cost, start, left, scored_rows(seq, start, left)) > config.max_step_s

    return outlasts


@dataclass(frozen=True)
class StepTimeBound:
    """A step's time target and the cost coefficients it is planned with."""

    target_s: float
    cost: StepCost
    min_chunk: int
    # How far such steps have recently run past their prediction (StepCostModel.overrun): the step is
    # planned that much shorter.
    overrun: float = 1.0
    # Whether streams' gaps wait on it (False: a step with nobody decoding, ``prefill_step_target_s``): only
    # such a step counts in the overrun and is planned shorter by it; the rest is throughput, not a promise.
    keeps_gaps: bool = True

    @property
    def planned_s(self) -> float:
        """What the step is planned to last: ``PLAN_TO`` of the target, less the recent overrun."""
        return PLAN_TO * self.target_s / self.overrun

    def fits(self, features: StepFeatures) -> bool:
        """Whether a step computing ``features`` is predicted within the target (as planned: ``planned_s``)."""
        return predict(self.cost, features) <= self.planned_s + 1e-12

    def room(self, features: StepFeatures, start: int | None = None, scores: bool = False) -> int:
        """Prefill tokens a step computing ``features`` so far may still take in a new chunk beginning at
        position ``start`` (None: leave out the chunk's fixed context cost, for an estimate of what is left),
        each of its rows ``scores``-ed for prompt logprobs or not."""
        start = start or 0
        so_far_s = predict(self.cost, features)
        left = self.planned_s - so_far_s - self.cost.per_context_token_s * start
        fits = _largest_chunk(left, self.cost, start, scores)
        overrun_anyway = so_far_s >= self.target_s
        # The step's guaranteed progress, less what it already holds.
        granted = self.granted(start, scores, overrun_anyway) - features.prefill_tokens
        return int(min(max(fits, granted, 0), 1 << 30))

    def granted(self, start: int, scores: bool = False, overrun_anyway: bool = False) -> int:
        """The prefill a step takes from position ``start`` whatever the prediction: ``min_chunk`` tokens, fewer
        where they would cost more than ``GRANTED_SHARE`` of the planned target (their attention deep into a
        long prompt, prompt scores, or a slow machine's rows at any depth); never less than one token, so the
        prompt always finishes. The guarantee is a time, not a count of tokens: a block of rows at position
        1,900 reads 1,900 positions each, and on a CPU where a block at a prompt's start cost more than the
        streams' whole bound, granting it anyway made every step beside them run past that bound.

        ``overrun_anyway``: what the step holds already is predicted past the target itself (its decodes alone,
        under a target no step of them can keep; not merely past the plan, which recent overruns shorten). Then
        no chunk keeps the bound, and the prompt's progress is not given up for it: its chunk may cost what
        ``min_chunk`` tokens cost at a prompt's start."""
        own = GRANTED_SHARE * self.planned_s - self.cost.per_context_token_s * start
        if overrun_anyway:
            own = max(own, _chunk_cost(self.cost, 0, self.min_chunk))  # plain rows: a scoring prompt's are dearer
        return int(min(self.min_chunk, max(1, _largest_chunk(own, self.cost, start, scores))))


def _chunk_cost(cost: StepCost, start: int, num_tokens: int, scored: int = 0) -> float:
    """What a prefill chunk adds to a step's predicted time (its context positions included), ``scored`` of
    its rows scored for prompt logprobs."""
    chunk = StepFeatures(num_tokens, 0, start + num_tokens, attention_pairs(start, num_tokens), scored)
    return predict(cost, chunk) - cost.base_s


def _largest_chunk(left_s: float, cost: StepCost, start: int, scores: bool = False) -> float:
    """The most prefill tokens from position ``start`` whose predicted cost fits in ``left_s`` (inf: any).

    n tokens cost ``(per_prefill + per_context [+ per_scored_row]) * n + per_pair * (n * start + n * (n + 1) / 2)``
    (scheduler/plan.py's attention pairs; a scored row for each token of a chunk that ``scores``, which
    over-counts its last prompt row by one): the positive root of that quadratic, floored.
    """
    if left_s < 0:
        return -1
    linear = cost.per_prefill_token_s + cost.per_context_token_s + cost.per_attention_pair_s * (start + 0.5)
    if scores:
        linear += cost.per_scored_row_s
    half_pair = cost.per_attention_pair_s / 2
    if linear <= 0 and half_pair <= 0:
        return math.inf
    # The root as 2c / (b + sqrt(b^2 + 4ac)): the textbook (-b + sqrt(...)) / 2a cancels when the pair term is
    # small beside the linear one, and a chunk predicted at exactly ``left_s`` then fell one token short.
    root = 2 * left_s / (linear + math.sqrt(linear * linear + 4 * half_pair * left_s))
    # Rounded a little past the floor: a prediction that lands on the target exactly must fit.
    return math.floor(root + 1e-9)


def scaled_share(share_tokens: int, room: int, max_tokens: int) -> int:
    """Tokens kept for worse queues in a step whose prefill room is ``room`` rather than ``max_tokens``:
    the same share of it, so a short room is not all kept (the better queue's prompt must advance too)."""
    if room >= max_tokens:
        return share_tokens
    return math.ceil(share_tokens * room / max_tokens)
