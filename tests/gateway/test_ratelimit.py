"""Sliding-window limits, the same behaviour from the in-process and the Redis backends."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest

from gateway.ratelimit import InProcessLimiter, Limits
from gateway.ratelimit.base import format_duration
from gateway.ratelimit.redis_budget import RedisLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def limiter(request):
    if request.param == "memory":
        lim = InProcessLimiter(window_s=60)
    else:
        lim = RedisLimiter(REDIS_URL, window_s=60, key_prefix=f"test:{uuid.uuid4().hex}")
    return lim  # each test closes it inside its own event loop (the Redis client is bound to it)


def run(coro):
    return asyncio.run(coro)


def test_requests_beyond_rpm_are_refused_with_retry_after(limiter):
    async def go():
        limits = Limits(rpm=3, tpm=10_000, max_concurrent=100)
        out = [await limiter.acquire("t", limits, f"r{i}", 1) for i in range(5)]
        await limiter.close()
        return out

    out = run(go())
    assert [d.allowed for d in out] == [True, True, True, False, False]
    assert out[3].reason == "requests"
    assert 0 < out[3].retry_after_s <= 60
    h = out[3].headers()
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert int(h["retry-after"]) >= 1


def test_tokens_are_reserved_and_unused_part_returned(limiter):
    async def go():
        limits = Limits(rpm=100, tpm=100, max_concurrent=100)
        a = await limiter.acquire("t", limits, "a", 60)
        b = await limiter.acquire("t", limits, "b", 60)  # 120 > 100: refused
        await limiter.release("t", "a", reserved_tokens=60, used_tokens=20)  # 40 come back
        c = await limiter.acquire("t", limits, "c", 60)  # 20 + 60 fits
        d = await limiter.acquire("t", limits, "d", 30)  # 80 + 30 does not
        await limiter.close()
        return a, b, c, d

    a, b, c, d = run(go())
    assert (a.allowed, b.allowed, c.allowed, d.allowed) == (True, False, True, False)
    assert b.reason == "tokens" and d.reason == "tokens"
    assert c.remaining_tokens == 20


def test_request_larger_than_tpm_is_never_retried(limiter):
    async def go():
        d = await limiter.acquire("t", Limits(rpm=10, tpm=50, max_concurrent=10), "big", 51)
        await limiter.close()
        return d

    d = run(go())
    assert not d.allowed and d.reason == "tokens" and math.isinf(d.retry_after_s)
    assert d.headers()["x-should-retry"] == "false"


def test_concurrency_slots_free_on_release(limiter):
    async def go():
        limits = Limits(rpm=100, tpm=10_000, max_concurrent=2)
        first = [await limiter.acquire("t", limits, f"r{i}", 1) for i in range(3)]
        await limiter.release("t", "r0", 1, 1)
        again = await limiter.acquire("t", limits, "r3", 1)
        await limiter.close()
        return first, again

    first, again = run(go())
    assert [d.allowed for d in first] == [True, True, False]
    assert first[2].reason == "concurrency"
    assert again.allowed


def test_concurrency_counts_every_sequence_of_a_request(limiter):
    """n choices (or a list of prompts) take n batch slots: the sender pays for them in its limit."""
    async def go():
        limits = Limits(rpm=100, tpm=10_000, max_concurrent=8)
        wide = await limiter.acquire("t", limits, "wide", 1, sequences=6)
        too_many = await limiter.acquire("t", limits, "three", 1, sequences=3)
        fits = await limiter.acquire("t", limits, "two", 1, sequences=2)
        await limiter.release("t", "wide", 1, 1)
        # More sequences than the whole limit: it waits for the tenant's other work, then runs alone.
        n16_beside = await limiter.acquire("t", limits, "n16-a", 1, sequences=16)
        await limiter.release("t", "two", 1, 1)
        n16_alone = await limiter.acquire("t", limits, "n16-b", 1, sequences=16)
        single = await limiter.acquire("t", limits, "one", 1)
        await limiter.release("t", "n16-b", 1, 1)
        after = await limiter.acquire("t", limits, "last", 1, sequences=8)
        await limiter.close()
        return wide, too_many, fits, n16_beside, n16_alone, single, after

    wide, too_many, fits, n16_beside, n16_alone, single, after = run(go())
    assert wide.allowed and fits.allowed and n16_alone.allowed and after.allowed
    assert (too_many.reason, n16_beside.reason, single.reason) == ("concurrency",) * 3


def test_tenants_have_separate_budgets(limiter):
    async def go():
        limits = Limits(rpm=1, tpm=100, max_concurrent=10)
        out = [await limiter.acquire(t, limits, f"{t}-1", 1) for t in ("a", "b")]
        await limiter.close()
        return out

    assert all(d.allowed for d in run(go()))


def test_window_slides_with_time():
    clock = FakeClock()
    lim = InProcessLimiter(window_s=60, clock=clock)
    limits = Limits(rpm=2, tpm=100, max_concurrent=10)

    async def go():
        await lim.acquire("t", limits, "a", 50)
        clock.now += 30
        await lim.acquire("t", limits, "b", 50)
        refused = await lim.acquire("t", limits, "c", 10)
        clock.now += 30.001  # "a" has left the window, "b" has not
        admitted = await lim.acquire("t", limits, "d", 50)
        return refused, admitted

    refused, admitted = run(go())
    assert not refused.allowed and refused.retry_after_s == pytest.approx(30)
    assert admitted.allowed


def test_token_reset_is_when_the_newest_entry_still_holding_tokens_leaves():
    clock = FakeClock()
    lim = InProcessLimiter(window_s=60, clock=clock)
    limits = Limits(rpm=100, tpm=1000, max_concurrent=10)

    async def go():
        await lim.acquire("t", limits, "a", 50)
        clock.now += 10
        await lim.acquire("t", limits, "b", 50)
        clock.now += 10
        await lim.acquire("t", limits, "c", 50)
        await lim.release("t", "c", reserved_tokens=50, used_tokens=0)  # "c" now holds nothing
        clock.now += 10
        return await lim.acquire("t", limits, "d", 0)  # holds nothing either

    decision = run(go())
    assert decision.allowed and decision.remaining_tokens == 900
    assert decision.reset_tokens_s == pytest.approx(40)  # "b" arrived at +10 s, leaves at +70 s; now is +30 s


def test_redis_budget_is_shared_by_two_limiters_under_concurrency():
    prefix = f"test:{uuid.uuid4().hex}"

    async def go():
        a = RedisLimiter(REDIS_URL, key_prefix=prefix)
        b = RedisLimiter(REDIS_URL, key_prefix=prefix)
        limits = Limits(rpm=25, tpm=1_000_000, max_concurrent=1000)
        decisions = await asyncio.gather(
            *[(a if i % 2 else b).acquire("shared", limits, f"r{i}", 1) for i in range(100)]
        )
        await a.close()
        await b.close()
        return decisions

    assert sum(d.allowed for d in run(go())) == 25


def test_durations_read_like_openai_headers():
    assert format_duration(0.02) == "20ms"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(360) == "6m0s"
    assert format_duration(0) == "0s"
