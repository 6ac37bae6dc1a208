"""Fair share in billing: a weight per tenant, and each request's queue time in the ledger and reports."""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest

from billing.errors import InvalidLimit
from billing.keys import authenticate, create_key
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.reports import usage_report
from billing.tenants import create_tenant, get_tenant, list_tenants, set_tenant
from engine.events import FinishEvent

NOON = datetime(2026, 3, 1, 12, tzinfo=UTC).timestamp()


def test_weight_defaults_to_one_and_reaches_the_authenticated_tenant(engine):
    create_tenant(engine, "acme", "standard")
    assert get_tenant(engine, "acme").weight == 1.0
    heavy = create_tenant(engine, "heavy", "standard", weight=2.5)
    assert heavy.weight == 2.5
    changed = set_tenant(engine, "acme", weight=4)
    assert changed.weight == 4.0 and changed.version == 2
    assert {t.name: t.weight for t in list_tenants(engine)} == {"acme": 4.0, "heavy": 2.5}
    _, secret = create_key(engine, "acme")
    assert authenticate(engine, secret).weight == 4.0


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), 1e6, 10**400, True, "2"])
def test_a_bad_weight_is_refused_and_changes_nothing(engine, weight):
    create_tenant(engine, "acme", "standard")
    with pytest.raises(InvalidLimit, match="weight"):
        set_tenant(engine, "acme", weight=weight)
    with pytest.raises(InvalidLimit, match="weight"):
        create_tenant(engine, "other", "standard", weight=weight)
    assert [(t.name, t.weight, t.version) for t in list_tenants(engine)] == [("acme", 1.0, 1)]


def test_queue_time_goes_from_the_engine_event_to_the_report_by_tenant(engine, tmp_path):
    meter, ledger = UsageMeter(), Ledger(engine, tmp_path / "spool.jsonl")
    for request_id, tenant, waited in [("a1", "light", 0.25), ("h1", "flood", 3.0), ("h2", "flood", 4.5)]:
        meter.begin(request_id, tenant, "standard", queued_at=NOON - 10)
        meter.on_finish(FinishEvent(request_id, prompt_tokens=4, completion_tokens=2, status="ok", tier="standard",
                          queued_at=NOON - 10, first_token_at=NOON - 5, finished_at=NOON, queue_s=waited))
        ledger.write(meter.take_record(request_id))
    rows = usage_report(engine, date(2026, 3, 1), date(2026, 3, 2), "tenant", "day", {"standard": 1.0})
    assert {r.group: r.queue_seconds for r in rows} == {"flood": 7.5, "light": 0.25}
    by_tier = usage_report(engine, date(2026, 3, 1), date(2026, 3, 2), "tier", "day", {"standard": 1.0})
    assert [r.queue_seconds for r in by_tier] == [7.75]
