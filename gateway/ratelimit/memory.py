"""The in-process budget: a sliding-window log per tenant, for one gateway process.

Same algorithm as the Redis script (see redis_budget.py for why a log and not
GCRA). All calls run on the event loop's thread, so no lock is needed; the
clock is injectable so tests can move time without sleeping.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.ratelimit.base import Decision, Limits

CONCURRENCY_RETRY_S = 1.0  # a slot frees when some stream ends: unknowable, so poll politely


@dataclass
class _Entry:
    at: float
    request_id: str
    tokens: int


@dataclass
class _TenantWindow:
    entries: deque[_Entry] = field(default_factory=deque)
    by_id: dict[str, _Entry] = field(default_factory=dict)
    tokens: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> concurrency slots held

    def expire(self, before: float) -> None:
        while self.entries and self.entries[0].at <= before:
            e = self.entries.popleft()
            self.tokens -= e.tokens
            self.by_id.pop(e.request_id, None)


class InProcessLimiter:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._tenants: dict[str, _TenantWindow] = {}

    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int, sequences: int = 1) -> Decision:
        now = self.clock()
        w = self._tenants.setdefault(tenant, _TenantWindow())
        w.expire(now - self.window_s)
        reset_req = w.entries[0].at + self.window_s - now if w.entries else 0.0
        reason, retry = None, 0.0
        slots = limits.slots_for(sequences)
        if sum(w.in_flight.values()) + slots > limits.max_concurrent:
            reason, retry = "concurrency", CONCURRENCY_RETRY_S
        elif len(w.entries) >= limits.rpm:
            reason, retry = "requests", reset_req
        elif tokens > limits.tpm:
            reason, retry = "tokens", math.inf
        elif w.tokens + tokens > limits.tpm:
            reason, retry = "tokens", self._tokens_free_in(w, w.tokens + tokens - limits.tpm, now)
        if reason is not None:
            return Decision(False, reason, retry, limits, limits.rpm - len(w.entries), limits.tpm - w.tokens,
                            reset_req, self._tokens_free_in(w, w.tokens, now))
        entry = _Entry(now, request_id, tokens)
        w.entries.append(entry)
        w.by_id[request_id] = entry
        w.tokens += tokens
        w.in_flight[request_id] = slots
        return Decision(True, None, 0.0, limits, limits.rpm - len(w.entries), limits.tpm - w.tokens,
                        w.entries[0].at + self.window_s - now, self._tokens_free_in(w, w.tokens, now))

    async def release(self, tenant: str, request_id: str, reserved_tokens: int, used_tokens: int) -> None:
        w = self._tenants.get(tenant)
        if w is None:
            return
        w.in_flight.pop(request_id, None)
        entry = w.by_id.get(request_id)
        refund = min(max(0, reserved_tokens - used_tokens), entry.tokens if entry else 0)
        if entry is not None and refund:
            entry.tokens -= refund
            w.tokens -= refund

    async def close(self) -> None:
        self._tenants.clear()

    def _tokens_free_in(self, w: _TenantWindow, needed: int, now: float) -> float:
        """Seconds until at least ``needed`` reserved tokens have left the window."""
        if needed == w.tokens > 0:
            # All of them (the reset header of every decision): that is when the newest entry still
            # holding tokens leaves. Scanning from the old end would cost the whole window's length.
            for e in reversed(w.entries):
                if e.tokens:
                    return max(0.0, e.at + self.window_s - now)
        freed = 0
        for e in w.entries:
            freed += e.tokens
            if freed >= needed:
                return max(0.0, e.at + self.window_s - now)
        return 0.0
