"""Concurrency slots in Redis are leases: renewed while their request runs, gone soon after their replica dies."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.ratelimit import Limits
from gateway.ratelimit.redis_budget import DEFAULT_LEASE_S, RedisLimiter

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
ONE_SLOT = Limits(rpm=1000, tpm=1_000_000, max_concurrent=1)
LEASE_S = 1.0


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex}"


def test_default_lease_frees_a_dead_replicas_slots_within_a_minute():
    assert DEFAULT_LEASE_S <= 30


def test_a_running_request_keeps_its_slot_past_the_lease_time(prefix):
    async def go():
        replica, other = (RedisLimiter(REDIS_URL, key_prefix=prefix, lease_s=LEASE_S) for _ in range(2))
        try:
            assert (await replica.acquire("t", ONE_SLOT, "long", 1)).allowed
            await asyncio.sleep(3 * LEASE_S)  # three leases: only the heartbeat keeps it
            refused = await other.acquire("t", ONE_SLOT, "next", 1)
            await replica.release("t", "long", 1, 1)
            admitted = await other.acquire("t", ONE_SLOT, "after", 1)  # released at once, no lease wait
            return refused, admitted
        finally:
            await replica.close()
            await other.close()

    refused, admitted = asyncio.run(go())
    assert not refused.allowed and refused.reason == "concurrency"
    assert admitted.allowed


def test_a_killed_replicas_slot_frees_within_one_lease(prefix):
    async def go():
        dying, survivor = (RedisLimiter(REDIS_URL, key_prefix=prefix, lease_s=LEASE_S) for _ in range(2))
        try:
            assert (await dying.acquire("t", ONE_SLOT, "orphan", 1)).allowed
            await asyncio.sleep(LEASE_S / 2)
            await dying.close()  # its heartbeat stops and nothing is released: what SIGKILL leaves
            assert not (await survivor.acquire("t", ONE_SLOT, "early", 1)).allowed
            await asyncio.sleep(LEASE_S + 0.2)
            return await survivor.acquire("t", ONE_SLOT, "late", 1)
        finally:
            await survivor.close()

    assert asyncio.run(go()).allowed


def test_renew_does_not_bring_back_a_released_lease(prefix):
    async def go():
        limiter = RedisLimiter(REDIS_URL, key_prefix=prefix, lease_s=LEASE_S)
        try:
            assert (await limiter.acquire("t", ONE_SLOT, "a", 1)).allowed
            await limiter.release("t", "a", 1, 1)
            limiter._held["a"] = ("t", 1)  # a renewal racing with the release
            renewed = await limiter.renew()
            return renewed, await limiter.acquire("t", ONE_SLOT, "b", 1)
        finally:
            await limiter.close()

    renewed, decision = asyncio.run(go())
    assert renewed == 0 and decision.allowed


def test_a_request_of_several_sequences_renews_and_releases_every_slot(prefix):
    async def go():
        limiter = RedisLimiter(REDIS_URL, key_prefix=prefix, lease_s=LEASE_S)
        limits = Limits(rpm=100, tpm=10_000, max_concurrent=4)
        try:
            assert (await limiter.acquire("t", limits, "wide", 1, sequences=3)).allowed
            renewed = await limiter.renew()
            beside = await limiter.acquire("t", limits, "two", 1, sequences=2)
            await limiter.release("t", "wide", 1, 1)
            return renewed, beside, await limiter.acquire("t", limits, "four", 1, sequences=4)
        finally:
            await limiter.close()

    renewed, beside, after = asyncio.run(go())
    assert renewed == 3 and beside.reason == "concurrency" and after.allowed
