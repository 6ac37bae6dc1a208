"""Moving averages of step time, prefill throughput and prompt length, for predicted TTFT."""

from __future__ import annotations

from scheduler.config import SchedulerConfig


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
