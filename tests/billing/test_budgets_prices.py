"""Prices by effective date, budget periods and a tenant's spend from the ledger, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from billing.budgets import budget_usage, delete_budget, list_budgets, set_budget
from billing.errors import InvalidBudget, InvalidPrice, UnknownBudget, UnknownTenant
from billing.ledger import Ledger
from billing.periods import period_at
from billing.prices import PriceBook, TierPrice, load_price_book, set_price
from billing.reports import usage_report
from billing.spend import spend_by_interval
from billing.tenants import create_tenant
from billing.usage_record import UsageRecord

JAN = datetime(2026, 1, 1)


def _epoch(moment: datetime) -> float:
    return moment.replace(tzinfo=UTC).timestamp()


def _rec(rid: str, when: datetime, tenant: str = "acme", tier: str = "premium", status: str = "ok",
         prompt: int = 100_000, completion: int = 50_000, gpu: float = 2.0) -> UsageRecord:
    return UsageRecord(rid, tenant, tier, None, status, _epoch(when) - 1, _epoch(when), prompt_tokens=prompt,
                       completion_tokens=completion, gpu_seconds=gpu)


@pytest.fixture
def ledger(engine, tmp_path):
    return Ledger(engine, tmp_path / "spool.jsonl")


@pytest.fixture
def acme(engine) -> str:
    create_tenant(engine, "acme", "premium")
    return "acme"


def test_a_price_change_mid_month_prices_each_request_by_its_own_date(engine, ledger, acme):
    set_price(engine, "premium", 0.01, 1.0, 2.0, effective_from=JAN, allow_past=True)
    set_price(engine, "premium", 0.02, 3.0, 4.0, effective_from=datetime(2026, 1, 15), allow_past=True)
    ledger.write(_rec("before", datetime(2026, 1, 10, 12)))
    ledger.write(_rec("after", datetime(2026, 1, 20, 12)))
    before = 2.0 * 0.01 + 0.1 * 1.0 + 0.05 * 2.0
    after = 2.0 * 0.02 + 0.1 * 3.0 + 0.05 * 4.0
    book = load_price_book(engine)
    with engine.connect() as c:
        spend = spend_by_interval(c, "acme", [JAN, datetime(2026, 2, 1)], book)
    assert spend.intervals[0].usd == pytest.approx(before + after)
    rows = usage_report(engine, JAN, datetime(2026, 2, 1), "tenant", "day")
    assert {r.bucket.day: round(r.usd, 6) for r in rows} == {10: round(before, 6), 20: round(after, 6)}
    assert all(r.usd == pytest.approx(r.gpu_usd + r.token_usd) for r in rows)
    month = usage_report(engine, JAN, datetime(2026, 2, 1), "tier", "day")
    assert sum(r.usd for r in month) == pytest.approx(before + after)


def test_a_price_set_now_does_not_reprice_the_past_and_none_before_costs_nothing(engine, ledger, acme):
    ledger.write(_rec("old", datetime(2026, 1, 5)))
    ledger.write(_rec("just-now", datetime.now(UTC).replace(tzinfo=None)))
    set_price(engine, "premium", 1.0, 1.0, 1.0)
    assert usage_report(engine, JAN, datetime(2027, 1, 1), "tier", "day")[-1].usd == 0.0  # from LEAD_S on
    rows = usage_report(engine, JAN, datetime(2026, 2, 1), "tenant", "day")
    assert [r.usd for r in rows] == [0.0]
    with pytest.raises(InvalidPrice, match="past"):
        set_price(engine, "premium", 1.0, 1.0, 1.0, effective_from=JAN)


@pytest.mark.parametrize("field, bad", [("tier", "gold"), ("per_gpu_second", -1.0),
                                        ("per_million_prompt_tokens", float("nan")), ("per_gpu_second", True)])
def test_a_bad_price_is_refused_naming_the_problem(engine, field, bad):
    args = {"tier": "premium", "per_gpu_second": 1.0, "per_million_prompt_tokens": 1.0,
            "per_million_completion_tokens": 1.0, field: bad}
    with pytest.raises(InvalidPrice, match=field if field != "tier" else "tier"):
        set_price(engine, **args)


def test_price_book_picks_the_price_in_effect_at_each_moment():
    book = PriceBook([TierPrice("premium", datetime(2026, 1, 15), 2.0), TierPrice("premium", JAN, 1.0)])
    assert book.at("premium", datetime(2025, 12, 31)).per_gpu_second == 0.0
    assert book.at("premium", datetime(2026, 1, 14, 23)).per_gpu_second == 1.0
    assert book.at("premium", datetime(2026, 1, 15)).per_gpu_second == 2.0
    assert book.at("standard", datetime(2026, 1, 15)).per_gpu_second == 0.0
    assert book.changes_within(JAN, datetime(2026, 2, 1)) == [datetime(2026, 1, 15)]


def test_a_month_runs_from_local_midnight_of_its_first_day():
    p = period_at("month", "Europe/Paris", JAN, datetime(2026, 3, 31, 22, 30))  # already April 1st in Paris
    assert (p.start, p.end) == (datetime(2026, 3, 31, 22), datetime(2026, 4, 30, 22))
    utc = period_at("month", "UTC", JAN, datetime(2026, 12, 31, 23, 59))
    assert (utc.start, utc.end) == (datetime(2026, 12, 1), datetime(2027, 1, 1))


def test_n_day_periods_follow_each_other_from_the_day_the_budget_was_set():
    anchor = datetime(2026, 1, 3, 15)
    assert period_at("7d", "UTC", anchor, datetime(2026, 1, 3, 16)).start == datetime(2026, 1, 3)
    p = period_at("7d", "UTC", anchor, datetime(2026, 1, 10, 0, 1))
    assert (p.start, p.end) == (datetime(2026, 1, 10), datetime(2026, 1, 17))


def test_budget_usage_counts_closed_rows_of_the_period_by_local_day(engine, ledger, acme):
    b = set_budget(engine, "acme", "tokens", 1_000_000, "month", 0.5, "UTC")
    for rid, when, status in [("a", datetime(2026, 1, 2, 10), "ok"), ("b", datetime(2026, 1, 2, 11), "cancelled"),
                              ("c", datetime(2026, 1, 3, 9), "interrupted"), ("d", datetime(2026, 1, 3, 9), "rejected"),
                              ("e", datetime(2026, 1, 4, 9), "open"), ("f", datetime(2026, 2, 1), "ok")]:
        ledger.write(_rec(rid, when, status=status, prompt=10, completion=5))
    usage = budget_usage(engine, b, load_price_book(engine), datetime(2026, 1, 20))
    assert usage.spent == 45 and usage.left == 1_000_000 - 45
    per_day = dict(usage.days)
    assert len(per_day) == 31 and per_day[date(2026, 1, 2)] == 30 and per_day[date(2026, 1, 3)] == 15
    assert per_day[date(2026, 1, 4)] == 0  # an open row counts once it closes


def test_budgets_are_one_per_tenant_and_unit_and_can_be_listed_and_removed(engine, acme):
    set_budget(engine, "acme", "tokens", 100)
    set_budget(engine, "acme", "tokens", 200, "7d", 0.9, "Asia/Tokyo")
    set_budget(engine, "acme", "usd", 12.5)
    got = [(b.unit, b.limit, b.period, b.timezone, b.soft) for b in list_budgets(engine, "acme")]
    assert got == [("tokens", 200, "7d", "Asia/Tokyo", 0.9), ("usd", 12.5, "month", "UTC", 0.8)]
    delete_budget(engine, "acme", "usd")
    assert [b.unit for b in list_budgets(engine)] == ["tokens"]
    with pytest.raises(UnknownBudget):
        delete_budget(engine, "acme", "usd")
    with pytest.raises(UnknownTenant):
        set_budget(engine, "nobody", "tokens", 1)


@pytest.mark.parametrize("args, message", [
    (("bytes", 1), "unit"), (("tokens", 0), "positive"), (("tokens", 1.5), "whole"), (("usd", float("inf")), "positive"),
    (("usd", 1, "month", 1.5), "soft"), (("usd", 1, "0d"), "period"), (("usd", 1, "month", 0.8, "Mars/Base"), "zone"),
])
def test_a_bad_budget_is_refused_naming_the_problem(engine, acme, args, message):
    with pytest.raises(InvalidBudget, match=message):
        set_budget(engine, "acme", *args)


def test_report_money_columns_are_in_every_format(engine, ledger, acme):
    from billing.report_formats import render

    set_price(engine, "premium", 0.5, 0.0, 0.0, effective_from=JAN, allow_past=True)
    ledger.write(_rec("a", datetime(2026, 1, 2)))
    rows = usage_report(engine, JAN, JAN + timedelta(days=5), "tenant", "day")
    assert "gpu_usd,token_usd,usd" in render(rows, "csv").splitlines()[0]
    assert '"usd": 1.0' in render(rows, "json") and "1.0000" in render(rows, "table")
