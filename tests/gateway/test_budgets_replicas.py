"""A token budget held across three replicas sharing Redis and PostgreSQL under 64 concurrent requests.

The replicas are in-process apps (each its own engine, limiter, budget gate and uvicorn server)
sharing one PostgreSQL schema and one Redis, as `tiergate serve` replicas would; three server
processes would cost minutes of start-up for the same code path.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import create_engine, text

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
PROMPT, MAX_TOKENS = "hey", 7  # 3 prompt tokens + 7 = 10 worst case, all used (the tiny model has no EOS)
BUDGET = 200

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def database_url() -> Iterator[str]:
    """Overrides the gateway tests' SQLite file: a fresh PostgreSQL schema, migrated."""
    from billing.db import upgrade

    schema = f"tg_budgets_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    upgrade(url)
    yield url
    with admin.connect() as c:
        c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


async def _fire(urls: list[str], key: str, model: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as http:
        async def one(i: int) -> httpx.Response:
            return await http.post(f"{urls[i % len(urls)]}/v1/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS})

        return await asyncio.gather(*[one(i) for i in range(n)])


def test_64_concurrent_requests_on_three_replicas_spend_no_more_than_the_token_budget(serve):
    from billing.budgets import set_budget

    prefix = f"test-budgets:{uuid.uuid4().hex}"
    replicas = [serve(redis_url=REDIS_URL, redis_key_prefix=prefix) for _ in range(3)]
    key = replicas[0].add_tenant("metered", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    set_budget(replicas[0].db, "metered", "tokens", BUDGET)
    for replica in replicas:  # each reads budgets afresh for /v1/usage (else within its poll, budget_poll_s)
        assert httpx.get(f"{replica.url}/v1/usage", headers={"authorization": f"Bearer {key}"}).json()["budgets"]
    responses = asyncio.run(_fire([r.url for r in replicas], key, replicas[0].engine.model_name, 64))
    codes = [r.status_code for r in responses]
    # Each admission holds 10 tokens and uses all 10: exactly BUDGET / 10 get through, whichever replica.
    assert codes.count(200) == BUDGET // 10 and codes.count(429) == 64 - BUDGET // 10
    refusals = [r.json()["error"] for r in responses if r.status_code == 429]
    assert {e["code"] for e in refusals} == {"insufficient_quota"}
    assert all("tokens budget" in e["message"] and "resets at" in e["message"] for e in refusals)
    with replicas[0].db.connect() as c:
        used = c.execute(text("SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage_ledger "
                              "WHERE tenant = 'metered' AND status = 'ok'")).scalar()
    assert used == BUDGET  # spent <= budget (+ one request's worst case at most; here exactly the budget)
    for replica in replicas:  # every replica sees the same state: spent, nothing held, nothing left
        usage = httpx.get(f"{replica.url}/v1/usage", headers={"authorization": f"Bearer {key}"}).json()
        (budget,) = usage["budgets"]
        assert (budget["unit"], budget["limit"], budget["spent"], budget["left"], budget["reserved"]) == \
            ("tokens", BUDGET, BUDGET, 0, 0)
