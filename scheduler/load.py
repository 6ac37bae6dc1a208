"""Predicted TTFT per tier: moving averages of step time, prefill throughput and prompt length, and the backlog;
``TierLoad``, the prediction the gateway's admission control reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.policy import Policy
from scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class TierLoad:
    """A tier's backlog as the gateway's admission control sees it."""

    queue_depth: int  # waiting sequences
    running: int
    predicted_ttft_s: float  # for a new request of this tier arriving now
    # Fair share: tenants take turns, so a tenant's new request waits for its own backlog and about
    # as much of each other tenant's, not for the whole tier's. None without fair share.
    newcomer_ttft_s: float | None = None  # a tenant with nothing queued in the tier
    tenant_ttft_s: Mapping[str | None, float] = field(default_factory=dict)  # tenants with work queued
    # Fair share: waiting sequences per tenant (each of n choices counts), for the queue bound's share.
    tenant_waiting: Mapping[str | None, int] = field(default_factory=dict)

    def predicted_ttft_for(self, tenant: str | None) -> float:
        """Predicted TTFT of a new request of ``tenant`` (None: unknown, the tier's prediction)."""
        if self.newcomer_ttft_s is None or tenant is None:
            return self.predicted_ttft_s
        return self.tenant_ttft_s.get(tenant, self.newcomer_ttft_s)


class LoadEstimator:
    """Exponential moving averages fed by every engine step.

    Prefill throughput is the ratio of two averages (prefill tokens and
    duration of the steps that had prefill work) rather than the average of
    per-step ratios, so a few tiny steps cannot inflate it.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        if not 0 < config.load_ema_alpha <= 1:
            raise ValueError("load_ema_alpha must be in (0, 1]")
        self.alpha = config.load_ema_alpha
        self.step_time_s = config.prior_step_time_s
        # Seeded so that the ratio starts at the prior throughput.
        self._prefill_tokens = config.prior_prefill_tokens_per_s * config.prior_step_time_s
        self._prefill_time_s = config.prior_step_time_s
        self._prior_prompt = float(config.prior_prompt_tokens)
        self._prompt_tokens: dict[str, float] = {}

    def _ema(self, old: float, new: float) -> float:
        return old + self.alpha * (new - old)

    def observe_step(self, duration_s: float, num_tokens: int, num_prefill_tokens: int) -> None:
        if duration_s < 0 or num_tokens < 0 or not 0 <= num_prefill_tokens <= num_tokens:
            raise ValueError("a step needs duration >= 0 and 0 <= prefill tokens <= tokens")
        if num_tokens == 0:
            return
        self.step_time_s = self._ema(self.step_time_s, duration_s)
        if num_prefill_tokens:
            self._prefill_tokens = self._ema(self._prefill_tokens, num_prefill_tokens)
            self._prefill_time_s = self._ema(self._prefill_time_s, duration_s)

    def observe_prompt(self, tier: str, num_tokens: int) -> None:
        old = self._prompt_tokens.get(tier, self._prior_prompt)
        self._prompt_tokens[tier] = self._ema(old, num_tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens / max(self._prefill_time_s, 1e-9)

    def typical_prompt(self, tier: str) -> float:
        return self._prompt_tokens.get(tier, self._prior_prompt)

    def predict_ttft(self, tier: str, tokens_ahead: int) -> float:
        """TTFT of a new ``tier`` request behind ``tokens_ahead`` queued prefill tokens."""
        return (tokens_ahead + self.typical_prompt(tier)) / self.prefill_tokens_per_s + self.step_time_s


def tier_loads(live: Iterable[Sequence], tiers: Iterable[str], estimator: LoadEstimator, policy: Policy
               ) -> dict[str, TierLoad]:
    """Per tier: queue depth, running and predicted TTFT of a new request.

    The policy says whose backlog is ahead of a tier, and whether tenants of a tier take
    turns (then the prediction is also per tenant).
    """
    tiers = list(tiers)
    waiting = dict.fromkeys(tiers, 0)
    running = dict.fromkeys(tiers, 0)
    queued = dict.fromkeys(tiers, 0)  # prefill tokens not yet computed
    by_tenant: dict[str, dict[str | None, int]] = {t: {} for t in tiers}
    waiting_by_tenant: dict[str, dict[str | None, int]] = {t: {} for t in tiers}
    for s in live:
        if s.status is SequenceStatus.WAITING:
            waiting[s.tier] += 1
            waiting_by_tenant[s.tier][s.tenant] = waiting_by_tenant[s.tier].get(s.tenant, 0) + 1
            left = s.num_tokens
        else:
            running[s.tier] += 1
            left = s.num_tokens - s.num_computed_tokens if s.is_prefilling else 0
        queued[s.tier] += left
        if left:
            by_tenant[s.tier][s.tenant] = by_tenant[s.tier].get(s.tenant, 0) + left
    result = {}
    for tier in tiers:
        ahead = policy.tiers_ahead(tier)
        newcomer, per_tenant = None, {}
        if policy.fair_within_tier:
            better = sum(queued[t] for t in ahead if t != tier)
            newcomer, per_tenant = _fair_predictions(tier, by_tenant[tier], better, estimator)
        result[tier] = TierLoad(
            queue_depth=waiting[tier],
            running=running[tier],
            predicted_ttft_s=estimator.predict_ttft(tier, sum(queued[t] for t in ahead)),
            newcomer_ttft_s=newcomer,
            tenant_ttft_s=per_tenant,
            tenant_waiting=waiting_by_tenant[tier] if policy.fair_within_tier else {},
        )
    return result


def _fair_predictions(
    tier: str, queued: dict[str | None, int], better: int, estimator: LoadEstimator
) -> tuple[float, dict[str | None, float]]:
    """(TTFT of a tenant with nothing queued, TTFT per tenant with work queued) under fair share.

    Taking turns, a request waits for its tenant's own backlog and, of every other tenant's, as
    much again plus one request (a tie); counters make the turns, so this is an estimate.
    """
    typical = estimator.typical_prompt(tier)
    newcomer = estimator.predict_ttft(tier, better + int(sum(min(n, typical) for n in queued.values())))
    per_tenant = {}
    for tenant, own in queued.items():
        others = sum(min(n, own + typical) for t, n in queued.items() if t != tenant)
        per_tenant[tenant] = estimator.predict_ttft(tier, int(better + own + others))
    return newcomer, per_tenant
