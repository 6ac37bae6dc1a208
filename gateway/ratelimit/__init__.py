"""Per-tenant rate limits: requests per minute, tokens per minute, concurrent requests.

``InProcessLimiter`` keeps the budget in this process; ``RedisLimiter`` keeps one
budget in Redis that every replica shares. Both implement the same sliding-window
log, so a test of one pins down the behaviour of the other.
"""

from gateway.ratelimit.base import Decision, LimiterUnavailable, Limits, RateLimiter
from gateway.ratelimit.memory import InProcessLimiter


def make_limiter(redis_url: str | None, window_s: float = 60.0, key_prefix: str = "tiergate:rl",
                 lease_s: float = 30.0) -> RateLimiter:
    """The in-process budget without a Redis URL (its slots die with the process, so need no lease)."""
    if not redis_url:
        return InProcessLimiter(window_s=window_s)
    from gateway.ratelimit.redis_budget import RedisLimiter

    return RedisLimiter(redis_url, window_s=window_s, key_prefix=key_prefix, lease_s=lease_s)


__all__ = ["Decision", "LimiterUnavailable", "Limits", "RateLimiter", "InProcessLimiter", "make_limiter"]
