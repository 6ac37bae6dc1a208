"""Usage reports: totals per bucket and tier/tenant/adapter, recompute on the payer's tier, prices, formats."""

from __future__ import annotations

import csv
import io
import json
import random
from datetime import UTC, date, datetime, timedelta

import pytest

from billing.errors import InvalidReport, MissingPrice
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.report_formats import render
from billing.reports import parse_prices, usage_report
from billing.usage_record import UsageRecord
from engine.events import FinishEvent, StepEvent, StepItem

DAY = datetime(2026, 3, 1, tzinfo=UTC)
PRICES = {"standard": 3600.0, "premium": 3 * 3600.0}  # per GPU-hour: 1 and 3 per GPU-second


def _at(hours: float) -> float:
    return (DAY + timedelta(hours=hours)).timestamp()


def _rec(rid, tenant, tier, hours, gpu, adapter=None, status="ok", recompute=None):
    return UsageRecord(rid, tenant, tier, adapter, status, _at(hours) - 1, _at(hours), prompt_tokens=10,
                       completion_tokens=5, gpu_seconds=gpu, recompute_by_tier=recompute or {})


@pytest.fixture
def ledger(engine, tmp_path):
    return Ledger(engine, tmp_path / "spool.jsonl")


@pytest.fixture
def sample(ledger):
    for record in [
        _rec("p1", "acme", "premium", 1.5, 2.0, adapter="sql"),
        _rec("p2", "acme", "premium", 2.5, 1.0),
        # A standard request preempted by premium: its recompute is premium's to pay.
        _rec("s1", "beta", "standard", 1.25, 4.0, adapter="sql", recompute={"premium": 0.5}),
        _rec("s2", "beta", "standard", 26.0, 1.0, status="cancelled"),
        _rec("x1", "beta", "standard", 3.0, 0.0, status="rejected"),
    ]:
        ledger.write(record)


def test_daily_report_per_tier_charges_recompute_to_the_preempting_tier(engine, sample):
    rows = usage_report(engine, date(2026, 3, 1), date(2026, 3, 3), "tier", "day", PRICES)
    got = {(r.bucket.day, r.group): r for r in rows}
    assert sorted(got) == [(1, "premium"), (1, "standard"), (2, "standard")]
    premium, standard = got[1, "premium"], got[1, "standard"]
    assert (premium.requests, premium.gpu_seconds, premium.recompute_gpu_seconds) == (2, 3.0, 0.5)
    assert premium.cost == pytest.approx((3.0 + 0.5) * 3)
    assert (standard.requests, standard.rejected, standard.gpu_seconds, standard.recompute_gpu_seconds) == (1, 1, 4.0, 0)
    assert (standard.prompt_tokens, standard.completion_tokens) == (20, 10)  # the rejected row counts its tokens
    assert standard.cost == pytest.approx(4.0)
    assert got[2, "standard"].requests == 1


def test_hourly_buckets_and_range_end_is_exclusive(engine, sample):
    rows = usage_report(engine, DAY, DAY + timedelta(hours=2), "tier", "hour", PRICES)
    assert [(r.bucket, r.group, r.requests) for r in rows] == [
        (datetime(2026, 3, 1, 1), "premium", 1),
        (datetime(2026, 3, 1, 1), "standard", 1),
    ]


def test_report_by_tenant_and_by_adapter(engine, sample):
    by_tenant = {r.group: r for r in usage_report(engine, DAY, DAY + timedelta(days=1), "tenant", "day", PRICES)}
    assert by_tenant["beta"].recompute_gpu_seconds == 0.5  # suffered, not paid
    assert by_tenant["beta"].cost == pytest.approx(4.0) and by_tenant["acme"].cost == pytest.approx(9.0)
    by_adapter = {r.group: r for r in usage_report(engine, DAY, DAY + timedelta(days=1), "adapter", "day", PRICES)}
    assert by_adapter["sql"].requests == 2 and by_adapter["sql"].cost == pytest.approx(2.0 * 3 + 4.0)
    assert by_adapter[None].requests == 1


def test_default_prices_make_premium_three_times_standard(engine, ledger, monkeypatch):
    monkeypatch.delenv("TIERGATE_PRICES", raising=False)
    ledger.write(_rec("p", "acme", "premium", 1, 10.0))
    ledger.write(_rec("s", "beta", "standard", 1, 10.0))
    rows = {r.group: r.cost for r in usage_report(engine, DAY, DAY + timedelta(days=1))}
    assert rows["premium"] == pytest.approx(3 * rows["standard"]) and rows["standard"] > 0


def test_the_batch_tier_has_its_own_row_at_half_the_standard_default_price(engine, ledger, monkeypatch):
    monkeypatch.delenv("TIERGATE_PRICES", raising=False)
    ledger.write(_rec("s", "beta", "standard", 1, 10.0))
    # A batch line preempted by interactive work pays its own recompute (scheduler/spare.py).
    ledger.write(_rec("b", "bulk", "batch", 1, 10.0, recompute={"batch": 2.0}))
    rows = {r.group: r for r in usage_report(engine, DAY, DAY + timedelta(days=1))}
    assert (rows["batch"].requests, rows["batch"].gpu_seconds, rows["batch"].recompute_gpu_seconds) == (1, 10.0, 2.0)
    assert rows["batch"].cost == pytest.approx(rows["standard"].cost / 2 * 1.2)


def test_report_errors(engine, ledger):
    ledger.write(_rec("g", "acme", "gold", 1, 1.0))
    with pytest.raises(MissingPrice, match="gold"):
        usage_report(engine, DAY, DAY + timedelta(days=1), prices=PRICES)
    with pytest.raises(InvalidReport):
        usage_report(engine, DAY, DAY + timedelta(days=1), group_by="model")
    with pytest.raises(InvalidReport):
        usage_report(engine, DAY, DAY + timedelta(days=1), bucket="week")
    with pytest.raises(InvalidReport):
        usage_report(engine, DAY, DAY)
    with pytest.raises(InvalidReport):
        parse_prices("standard:2")
    assert parse_prices("standard=2, premium=6.5") == {"standard": 2.0, "premium": 6.5}


def test_report_accepts_a_url(db_url, sample):
    assert len(usage_report(db_url, DAY, DAY + timedelta(days=1), prices=PRICES)) == 2


def test_renderers_agree_on_the_rows(engine, sample):
    rows = usage_report(engine, DAY, DAY + timedelta(days=2), "tier", "day", PRICES)
    as_json = json.loads(render(rows, "json"))
    as_csv = list(csv.DictReader(io.StringIO(render(rows, "csv"))))
    table = render(rows, "table").splitlines()
    assert len(as_json) == len(as_csv) == len(table) - 1 == len(rows)
    assert [j["group"] for j in as_json] == [c["group"] for c in as_csv] == ["premium", "standard", "standard"]
    assert table[0].split() == list(as_json[0])
    with pytest.raises(InvalidReport):
        render(rows, "xml")


def test_ledger_gpu_seconds_add_up_to_engine_busy_time(engine, ledger):
    """Conservation end to end: a mixed run through meter, ledger and report."""
    rng = random.Random(3)
    meter = UsageMeter()
    live = {f"r{i}": rng.choice(["premium", "standard"]) for i in range(30)}
    for rid, tier in live.items():
        meter.begin(rid, "acme" if tier == "premium" else "beta", tier, queued_at=_at(1))
    while live:
        batch = rng.sample(sorted(live), min(len(live), 4))
        meter.on_step(StepEvent(rng.uniform(0.01, 0.1), tuple(
            StepItem(rid, rng.randint(1, 32), live[rid] == "standard" and rng.random() < 0.3, "premium")
            for rid in batch
        )))
        for rid in batch:
            if rng.random() < 0.25:
                del live[rid]
                meter.on_finish(FinishEvent(rid, 10, 5, "ok", finished_at=_at(2)))
                ledger.write(meter.take_record(rid))
    rows = usage_report(engine, DAY, DAY + timedelta(days=1), "tier", "day", PRICES)
    billed = sum(r.gpu_seconds + r.recompute_gpu_seconds for r in rows)
    assert billed == pytest.approx(meter.busy_seconds, rel=0.01)
    recompute = {r.group: r.recompute_gpu_seconds for r in rows}
    assert recompute["premium"] > 0 and recompute.get("standard", 0) == 0
