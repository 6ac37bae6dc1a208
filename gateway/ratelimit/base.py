"""What a limiter is asked (a tenant's limits and a reservation) and what it answers (a decision and headers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    rpm: int
    tpm: int
    max_concurrent: int  # sequences in flight (n x prompts per request), not requests

    def slots_for(self, sequences: int) -> int:
        """Concurrency slots a request of ``sequences`` holds: one per sequence, at most the whole limit.

        Every sequence takes a batch slot in the engine, so ``n`` or a list prompt is paid for in
        slots; a request asking for more than the limit holds all of it (it runs alone) rather than
        being refused for ever.
        """
        return max(1, min(sequences, self.max_concurrent))


@dataclass(frozen=True)
class Decision:
    """A limiter's answer; ``reason`` is None when admitted, else "requests", "tokens" or "concurrency"."""

    allowed: bool
    reason: str | None
    retry_after_s: float  # when a retry could succeed; math.inf when it never can (request too large)
    limits: Limits
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        h = {
            "x-ratelimit-limit-requests": str(self.limits.rpm),
            "x-ratelimit-remaining-requests": str(max(0, self.remaining_requests)),
            "x-ratelimit-reset-requests": format_duration(self.reset_requests_s),
            "x-ratelimit-limit-tokens": str(self.limits.tpm),
            "x-ratelimit-remaining-tokens": str(max(0, self.remaining_tokens)),
            "x-ratelimit-reset-tokens": format_duration(self.reset_tokens_s),
        }
        if not self.allowed:
            h.update(retry_headers(self.retry_after_s))
        return h


def retry_headers(retry_after_s: float) -> dict[str, str]:
    if math.isinf(retry_after_s):
        # openai's clients retry every 429 unless told not to; waiting cannot help this one.
        return {"x-should-retry": "false"}
    # Retry-After is whole seconds by RFC 9110; retry-after-ms is what OpenAI's SDKs read first.
    return {"retry-after": str(max(1, math.ceil(retry_after_s))), "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000)))}


def format_duration(seconds: float) -> str:
    """OpenAI's duration style for the reset headers: "20ms", "1.5s", "6m0s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"


class LimiterUnavailable(Exception):
    """The shared budget cannot be reached (Redis down or not answering): nothing was reserved."""


class RateLimiter(Protocol):
    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int, sequences: int = 1) -> Decision:
        """Admit one request of ``sequences`` sequences reserving ``tokens`` of the TPM budget (and
        ``limits.slots_for(sequences)`` concurrency slots), or refuse it and change nothing."""
        ...

    async def release(self, tenant: str, request_id: str, reserved_tokens: int, used_tokens: int) -> None:
        """End an admitted request: free its concurrency slot and give back the unused reservation."""
        ...

    async def close(self) -> None: ...
