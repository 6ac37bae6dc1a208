"""Budget stores, in process and in Redis, keep the same rules: holds, settle-once, rebuilds, two periods."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime

import pytest

from gateway.ratelimit.budget_redis import RedisBudgetStore
from gateway.ratelimit.budget_store import Ask, BudgetKey, InProcessBudgetStore, Settlement

REDIS_URL = "redis://127.0.0.1:6379/0"
NOV = BudgetKey("acme", "tokens", "month@UTC", datetime(2026, 11, 1), datetime(2026, 12, 1))
DEC = BudgetKey("acme", "tokens", "month@UTC", datetime(2026, 12, 1), datetime(2027, 1, 1))
T0 = 1_800_000_000.0  # loaded_at of the states below


@pytest.fixture(params=["memory", "redis"])
def kind(request) -> str:
    return request.param


def run(kind: str, body) -> None:
    """``body(store)`` on a fresh store of ``kind``, in one event loop (a Redis client belongs to its loop)."""
    async def main() -> None:
        store = InProcessBudgetStore() if kind == "memory" else \
            RedisBudgetStore(REDIS_URL, key_prefix=f"test-budget:{uuid.uuid4().hex}")
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())


def test_reservations_stop_at_the_limit_and_a_settlement_frees_the_unused_part(kind):
    async def go(store):
        assert await store.reserve(NOV, "r1", 10, 25, T0) is None  # not loaded: the gate loads it first
        await store.load(NOV, 5.0, [], T0, T0 - 30)
        first = await store.reserve(NOV, "r1", 10, 25, T0 + 1)
        assert first.allowed and first.spent == 5 and first.held == 10
        second = await store.reserve(NOV, "r2", 10, 25, T0 + 1)
        assert second.allowed and second.held == 20
        refused = await store.reserve(NOV, "r3", 10, 25, T0 + 1)
        assert not refused.allowed and (refused.spent, refused.held) == (5, 20)
        spent = await store.settle(Settlement("r1", 4, T0 + 1, T0 + 2, NOV, NOV))
        assert spent == 9 and await store.state(NOV) == (9, 10)
        assert (await store.reserve(NOV, "r3", 6, 25, T0 + 3)).allowed  # 9 + 10 + 6 = 25
    run(kind, go)


def test_a_second_settlement_of_a_request_changes_nothing(kind):
    async def go(store):
        await store.load(NOV, 0.0, [], T0, T0 - 30)
        await store.reserve(NOV, "r1", 10, 100, T0 + 1)
        await store.settle(Settlement("r1", 7, T0 + 1, T0 + 2, NOV, NOV))
        await store.settle(Settlement("r1", 7, T0 + 1, T0 + 2, NOV, NOV))
        await store.settle(Settlement("r1", 7, T0 + 1, T0 + 2, NOV, NOV, require_hold=True))
        assert await store.state(NOV) == (7, 0)
    run(kind, go)


def test_a_load_after_another_replicas_load_is_ignored(kind):
    async def go(store):
        await store.load(NOV, 3.0, [], T0, T0 - 30)
        await store.reserve(NOV, "r1", 10, 100, T0 + 1)
        await store.load(NOV, 99.0, [], T0 + 2, T0 - 28)
        assert await store.state(NOV) == (3, 10)
    run(kind, go)


def test_after_a_rebuild_a_request_admitted_before_it_counts_once_and_rows_already_summed_not_at_all(kind):
    async def go(store):
        # Rebuilt at T0: rows finished before T0 - 30 are in `spent`; "recent" finished after and is counted.
        await store.load(NOV, 50.0, ["recent"], T0, T0 - 30)
        # Its hold was lost with the old state; it ends after the rebuild: counted, once.
        assert await store.settle(Settlement("running", 8, T0 - 100, T0 + 5, NOV, NOV)) == 58
        assert await store.settle(Settlement("running", 8, T0 - 100, T0 + 5, NOV, NOV)) == 58
        # Ended just before the rebuild, read one by one by it: not again.
        assert await store.settle(Settlement("recent", 4, T0 - 100, T0 - 10, NOV, NOV)) == 58
        # Ended long before: in the rebuilt sum.
        assert await store.settle(Settlement("old", 4, T0 - 100, T0 - 60, NOV, NOV)) == 58
        # Admitted after the rebuild with no hold: it was settled already (by the sweep), so not again.
        assert await store.settle(Settlement("later", 4, T0 + 1, T0 + 2, NOV, NOV)) == 58
    run(kind, go)


def test_a_request_across_the_month_end_frees_its_hold_and_counts_in_the_month_it_ended(kind):
    async def go(store):
        await store.load(NOV, 0.0, [], T0, T0 - 30)
        await store.reserve(NOV, "r1", 10, 100, T0 + 1)
        await store.load(DEC, 0.0, [], T0 + 2, T0 - 28)
        assert await store.settle(Settlement("r1", 6, T0 + 1, T0 + 3, NOV, DEC)) == 6
        assert await store.settle(Settlement("r1", 6, T0 + 1, T0 + 3, NOV, DEC)) == 6
        assert await store.state(NOV) == (0, 0) and await store.state(DEC) == (6, 0)
    run(kind, go)


def test_the_sweep_settles_only_holds_it_still_finds(kind):
    async def go(store):
        await store.load(NOV, 0.0, [], T0 - 100, T0 - 130)
        await store.reserve(NOV, "orphan", 10, 100, T0 - 50)
        assert [(h.request_id, h.amount) for h in await store.holds(NOV)] == [("orphan", 10)]
        assert await store.settle(Settlement("orphan", 3, T0 - 50, T0 - 40, NOV, NOV, require_hold=True)) == 3
        assert await store.settle(Settlement("orphan", 3, T0 - 50, T0 - 40, NOV, NOV, require_hold=True)) is None
        assert await store.holds(NOV) == [] and await store.state(NOV) == (3, 0)
    run(kind, go)


def test_the_soft_threshold_warns_once_per_period(kind):
    async def go(store):
        await store.load(NOV, 0.0, [], T0, T0 - 30)
        assert [await store.first_soft_crossing(NOV) for _ in range(3)] == [True, False, False]
        assert not await store.first_soft_crossing(DEC)  # not loaded: nothing to warn about
    run(kind, go)


def test_release_gives_the_whole_hold_back(kind):
    async def go(store):
        await store.load(NOV, 0.0, [], T0, T0 - 30)
        await store.reserve(NOV, "r1", 10, 10, T0 + 1)
        await store.release(NOV, "r1")
        await store.release(NOV, "r1")
        assert await store.state(NOV) == (0, 0) and (await store.reserve(NOV, "r2", 10, 10, T0 + 2)).allowed
    run(kind, go)


def test_a_request_holds_in_all_its_budgets_or_in_none(kind):
    usd = BudgetKey("acme", "usd", "month@UTC", NOV.start, NOV.end)

    async def go(store):
        out = await store.reserve_all([Ask(NOV, 10, 100), Ask(usd, 2, 5)], "r1", T0)
        assert out.missing == [0, 1] and not out.allowed
        await store.load(NOV, 0.0, [], T0, T0 - 30)
        await store.load(usd, 4.0, [], T0, T0 - 30)
        out = await store.reserve_all([Ask(NOV, 10, 100), Ask(usd, 2, 5)], "r1", T0)
        assert not out.allowed and [d.allowed for d in out.decisions] == [True, False]
        assert await store.state(NOV) == (0, 0)
        out = await store.reserve_all([Ask(NOV, 10, 100), Ask(usd, 1, 5)], "r1", T0)
        assert out.allowed and [(d.spent, d.held) for d in out.decisions] == [(0, 10), (4, 1)]
        assert await store.settle_all([Settlement("r1", 7, T0, T0 + 1, NOV, NOV),
                                       Settlement("r1", 0.5, T0, T0 + 1, usd, usd)]) == [7, 4.5]
    run(kind, go)
