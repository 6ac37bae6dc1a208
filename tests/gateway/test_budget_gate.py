"""The budget gate on a real ledger: reservations, settlement from rows, rebuilds after a lost state, a month's end."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
import redis
from tests.support.faults import PrivateRedis

from billing.budgets import set_budget
from billing.db import create_engine_for, upgrade
from billing.ledger import Ledger
from billing.prices import set_price
from billing.tenants import create_tenant
from billing.usage_record import UsageRecord
from billing.usage_record import utc_datetime
from gateway.budget_gate import BudgetGate, budget_key
from gateway.errors import APIError
from gateway.ratelimit.budget_redis import RedisBudgetStore
from gateway.ratelimit.budget_store import BudgetKey, InProcessBudgetStore

REDIS_URL = "redis://127.0.0.1:6379/0"


class Clock:
    def __init__(self, moment: datetime) -> None:
        self.now = moment.replace(tzinfo=UTC).timestamp()

    def __call__(self) -> float:
        return self.now

    def set(self, moment: datetime) -> None:
        self.now = moment.replace(tzinfo=UTC).timestamp()


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'gate.db'}"
    upgrade(url)
    engine = create_engine_for(url)
    create_tenant(engine, "acme", "premium")
    yield engine
    engine.dispose()


@pytest.fixture(params=["memory", "redis", "redis-restarted"])
def make_store(request, tmp_path):
    """A store factory and a way to lose every state: a process restart in process; in Redis, its keys
    deleted, or a private redis-server (no persistence) really restarted."""
    prefix = f"test-gate:{uuid.uuid4().hex}"
    if request.param == "redis-restarted":
        server = PrivateRedis(tmp_path)
        request.addfinalizer(server.stop)
        return (lambda: RedisBudgetStore(server.url, key_prefix=prefix)), lambda gate: server.restart()
    if request.param == "memory":
        holder = {}

        def make():
            holder["store"] = InProcessBudgetStore()
            return holder["store"]

        def lose(gate):
            gate.store = make()
        return make, lose

    def lose_redis(gate):
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()
    return (lambda: RedisBudgetStore(REDIS_URL, key_prefix=prefix)), lose_redis


def record(rid: str, clock: Clock, queued_at: float, completion: int, prompt: int = 10,
           status: str = "ok") -> UsageRecord:
    return UsageRecord(rid, "acme", "premium", None, status, queued_at, clock(), prompt_tokens=prompt,
                       completion_tokens=completion, gpu_seconds=0.5)


async def finish(gate: BudgetGate, ledger: Ledger, rec: UsageRecord) -> None:
    """What the gateway does at a request's end: the row made durable, then settled."""
    ledger.write(rec)
    await gate.settle(rec)


async def spent(gate: BudgetGate) -> float:
    return (await gate.store.state(_key(gate, gate.clock)))[0]


def test_a_lost_state_is_rebuilt_from_the_ledger_and_counts_a_request_in_flight_once(db, make_store, tmp_path):
    make, lose = make_store
    set_budget(db, "acme", "tokens", 1000)
    clock = Clock(datetime(2026, 6, 10, 12))
    ledger = Ledger(db, tmp_path / "spool.jsonl")

    async def go():
        gate = BudgetGate(db, make(), clock=clock)
        t = clock()
        await gate.admit("r1", "acme", "premium", t, 10, 90)
        await finish(gate, ledger, record("r1", clock, t, 40))
        assert await spent(gate) == 50
        await gate.admit("r2", "acme", "premium", t, 10, 90)  # runs across the loss below
        lose(gate)
        clock.now += 5
        await gate.admit("r3", "acme", "premium", clock(), 10, 90)  # rebuilt here: r1 only
        assert await spent(gate) == 50
        clock.now += 1
        await finish(gate, ledger, record("r2", clock, t, 20))
        await gate.settle(record("r2", clock, t, 20))  # twice: once only
        await finish(gate, ledger, record("r3", clock, clock() - 1, 30))
        assert await spent(gate) == 50 + 30 + 40
        lose(gate)
        clock.now += 60
        await gate.admit("r4", "acme", "premium", clock(), 10, 90)
        assert await spent(gate) == 120  # rebuilt again: the ledger's sum, neither reset nor doubled
        await gate.close()

    asyncio.run(go())


def test_a_month_rolls_over_on_the_test_clock_and_a_request_across_it_counts_in_the_new_month(db, make_store,
                                                                                              tmp_path):
    make, _ = make_store
    set_budget(db, "acme", "tokens", 100)
    clock = Clock(datetime(2026, 1, 31, 23, 59, 40))
    ledger = Ledger(db, tmp_path / "spool.jsonl")

    async def go():
        gate = BudgetGate(db, make(), clock=clock)
        t = clock()
        await gate.admit("jan", "acme", "premium", t, 10, 50)
        clock.now += 5
        await finish(gate, ledger, record("jan", clock, t, 50))
        with pytest.raises(APIError) as refused:
            await gate.admit("over", "acme", "premium", clock(), 10, 50)  # 60 + 60 > 100
        assert refused.value.code == "insufficient_quota" and "2026-02-01T00:00:00Z" in refused.value.message
        across = clock()
        await gate.admit("across", "acme", "premium", across, 10, 20)  # 60 + 30 fits January
        clock.set(datetime(2026, 2, 1, 0, 0, 5))
        await gate.admit("feb", "acme", "premium", clock(), 10, 50)  # February: a fresh period
        await finish(gate, ledger, record("across", clock, across, 20))
        await finish(gate, ledger, record("feb", clock, clock(), 50))
        assert await spent(gate) == 30 + 60
        clock.set(datetime(2026, 1, 31, 23, 59, 59))  # back in January: the hold of "across" is gone
        assert await spent(gate) == 60
        await gate.close()

    asyncio.run(go())


def test_a_refusal_in_one_budget_gives_back_what_the_others_held(db, make_store):
    make, _ = make_store
    set_budget(db, "acme", "tokens", 1000)
    set_budget(db, "acme", "usd", 0.01)
    set_price(db, "premium", 0.0, 1000.0, 1000.0, effective_from=datetime(2026, 1, 1), allow_past=True)
    clock = Clock(datetime(2026, 6, 10, 12))

    async def go():
        gate = BudgetGate(db, make(), clock=clock)
        with pytest.raises(APIError) as refused:
            await gate.admit("r1", "acme", "premium", clock(), 10, 90)  # tokens first, then USD: 0.1 > 0.01
        assert "USD budget" in refused.value.message and "needs up to 0.1." in refused.value.message
        assert await gate.store.state(_key(gate, clock)) == (0, 0)  # the tokens budget held it, then gave it back
        await gate.close()

    asyncio.run(go())


def test_the_sweep_settles_a_dead_processs_hold_from_its_closed_row(db, make_store, tmp_path):
    make, _ = make_store
    set_budget(db, "acme", "tokens", 1000)
    clock = Clock(datetime(2026, 6, 10, 12))
    ledger = Ledger(db, tmp_path / "spool.jsonl")

    async def go():
        dead = BudgetGate(db, make(), clock=clock)
        await dead.admit("r1", "acme", "premium", clock(), 10, 90)
        await dead.admit("r2", "acme", "premium", clock(), 10, 90)
        ledger.write(record("r1", clock, clock(), 33, status="interrupted"))  # closed by the orphan sweep
        clock.now += 200
        survivor = BudgetGate(db, dead.store, clock=clock)
        await asyncio.to_thread(survivor.refresh)
        assert await survivor.sweep(orphan_after_s=60) == 2  # r2 never wrote a row: released as nothing
        assert await survivor.store.state(_key(survivor, clock)) == (43, 0)
        assert await survivor.sweep(orphan_after_s=60) == 0
        await dead.close()

    asyncio.run(go())


def _key(gate: BudgetGate, clock) -> BudgetKey:
    """The state of the tenant's first budget (by unit) in the period of the clock's time."""
    return budget_key(gate.budgets["acme"][0], utc_datetime(clock()))


def test_a_gpu_seconds_budget_reserves_twice_what_the_tiers_finished_requests_cost_per_token(db, tmp_path):
    set_budget(db, "acme", "gpu_seconds", 5.0)
    clock = Clock(datetime(2026, 6, 10, 12))

    async def go():
        gate = BudgetGate(db, InProcessBudgetStore(), clock=clock)
        seen = UsageRecord("seen", "other", "premium", None, "ok", clock(), clock(), prompt_tokens=60,
                           completion_tokens=40, gpu_seconds=1.0)
        await gate.settle(seen)  # 0.01 GPU-second per token, from a tenant without budgets
        await gate.admit("r1", "acme", "premium", clock(), 50, 50)  # holds 100 x 0.01 x 2 = 2
        await gate.admit("r2", "acme", "premium", clock(), 50, 50)  # 4
        with pytest.raises(APIError, match="needs up to 2"):
            await gate.admit("r3", "acme", "premium", clock(), 50, 50)
        assert await gate.store.state(_key(gate, clock)) == (0, pytest.approx(4.0))
        await gate.close()

    asyncio.run(go())
