"""After Redis restarts, the shared limiter's pooled connections are stale: the first use must not fail a request."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from tests.support.faults import PrivateRedis

from gateway.ratelimit import Limits
from gateway.ratelimit.redis_budget import RedisLimiter

LIMITS = Limits(rpm=10_000, tpm=10_000_000, max_concurrent=1000)


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()


def test_every_request_after_a_redis_restart_is_admitted(private_redis):
    async def go() -> list[bool]:
        limiter = RedisLimiter(private_redis.url, key_prefix=f"test:{uuid.uuid4().hex}")
        try:
            # Several pooled connections, as concurrent requests leave them.
            first = await asyncio.gather(*(limiter.acquire("t", LIMITS, f"a{i}", 1) for i in range(8)))
            assert all(d.allowed for d in first)
            await asyncio.to_thread(private_redis.restart)
            after = []
            for round_ in range(3):
                after += await asyncio.gather(*(limiter.acquire("t", LIMITS, f"b{round_}-{i}", 1) for i in range(8)))
            await limiter.release("t", "b0-0", 1, 1)
            return [d.allowed for d in after]
        finally:
            await limiter.close()

    assert asyncio.run(go()) == [True] * 24
