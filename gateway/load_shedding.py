"""Admission control: refuse work the engine cannot start within the caller's tier SLO.

The engine publishes, per tier, a predicted TTFT for a request arriving now
(queued prefill work over measured step speed). A request is refused with 429
``overloaded`` instead of queueing without bound when:
- its tier's queue is full (premium's bound is larger than standard's) and, under fair share,
  its tenant already holds its share of that queue (the bound over the tenants waiting, in
  sequences: n choices count n), so one tenant filling the queue sheds itself, not its
  neighbours; past ``hard_queue_factor`` times the bound everyone is refused;
- its tier has an SLO and the prediction exceeds it;
- it is standard (no SLO of its own) and either its predicted wait exceeds
  ``standard_max_wait_s``, or premium's prediction is already past
  ``standard_shed_fraction`` of premium's SLO: standard work competes with
  premium for the same steps, so it is shed first, before premium misses.
Retry-After is the predicted drain time of the backlog that caused the refusal.
A spare-capacity tier (batch) is refused only when its queue is full: its lines wait for idle
steps by design, and its backlog is no interactive tier's (scheduler/spare.py).

Only a backlog (requests waiting in a queue) is a reason to refuse for
latency: on hardware whose single prefill already exceeds the SLO (a laptop
CPU), an idle engine still serves the request as fast as it ever could, and
a retry later would be no faster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.config import TierConfig
from scheduler.load import TierLoad


@dataclass(frozen=True)
class SheddingPolicy:
    max_queued: int = 256  # per tier with the best priority; worse tiers get standard_queue_fraction of it
    standard_queue_fraction: float = 0.5
    standard_shed_fraction: float = 0.8
    standard_max_wait_s: float = 30.0
    hard_queue_factor: float = 2.0  # under fair share, tenants under their share queue up to this times the bound


@dataclass(frozen=True)
class Refusal:
    reason: str  # metrics label: "slo" (predicted TTFT) or "overload" (queue full)
    message: str
    retry_after_s: float


class LoadShedder:
    def __init__(self, tiers: tuple[TierConfig, ...], policy: SheddingPolicy = SheddingPolicy()) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.policy = policy
        self.best = min(tiers, key=lambda t: t.priority)

    def queue_bound(self, tier: str) -> int:
        if tier == self.best.name:
            return self.policy.max_queued
        return max(1, int(self.policy.max_queued * self.policy.standard_queue_fraction))

    def check(self, tier: str, load: Mapping[str, TierLoad], tenant: str | None = None) -> Refusal | None:
        """Under fair share a ``tenant`` with nothing waiting is judged by its own predicted wait,
        not by the backlog other tenants of its tier built: their flood must not shed it."""
        mine = load.get(tier)
        if mine is None:
            return None  # the engine has not published a load for this tier yet: nothing is queued
        predicted = mine.predicted_ttft_for(tenant)
        config = self.tiers[tier]
        if self._queue_full(tier, mine, tenant):
            return Refusal("overload", f"The {tier} queue is full ({mine.queue_depth} requests waiting); "
                           "retry later.", mine.predicted_ttft_s)
        if config.spare_only:
            return None
        if config.ttft_slo_s is not None:
            if mine.queue_depth > 0 and predicted > config.ttft_slo_s:
                return Refusal("slo", f"The server is overloaded: predicted time to first token "
                               f"{predicted:.2f}s exceeds the {tier} SLO of {config.ttft_slo_s}s.",
                               predicted - config.ttft_slo_s)
            return None
        if mine.queue_depth > 0 and predicted > self.policy.standard_max_wait_s:
            return Refusal("slo", f"The server is overloaded: predicted wait {predicted:.1f}s.",
                           predicted - self.policy.standard_max_wait_s)
        best_load = load.get(self.best.name)
        if tier != self.best.name and self._backlogged(load, self.best.name) and self.best.ttft_slo_s is not None:
            threshold = self.best.ttft_slo_s * self.policy.standard_shed_fraction
            if best_load.predicted_ttft_s > threshold:
                return Refusal("slo", "The server is overloaded; requests of higher tiers come first.",
                               best_load.predicted_ttft_s)
        return None

    def _queue_full(self, tier: str, mine: TierLoad, tenant: str | None) -> bool:
        bound = self.queue_bound(tier)
        if mine.queue_depth < bound:
            return False
        if tenant is None or not mine.tenant_waiting or mine.queue_depth >= bound * self.policy.hard_queue_factor:
            return True
        own = mine.tenant_waiting.get(tenant, 0)
        sharing = len(mine.tenant_waiting) + (0 if own else 1)
        return own >= bound / sharing

    @staticmethod
    def _backlogged(load: Mapping[str, TierLoad], tier: str) -> bool:
        tier_load = load.get(tier)
        return tier_load is not None and tier_load.queue_depth > 0
