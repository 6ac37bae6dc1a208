"""Metering: step time split by tokens, recompute charged to the preempting tier, nothing lost or invented."""

from __future__ import annotations

import random

import pytest

from billing.meter import UsageMeter
from engine.events import FinishEvent, StepEvent, StepItem


def _finish(request_id, status="ok", **kw):
    return FinishEvent(request_id, prompt_tokens=kw.pop("prompt", 10), completion_tokens=kw.pop("completion", 5),
                       status=status, finished_at=1000.0, **kw)


def test_step_time_is_split_by_token_share():
    meter = UsageMeter()
    meter.begin("a", "acme", "premium", "sql", queued_at=990.0)
    meter.begin("b", "beta", "standard")
    meter.on_step(StepEvent(0.4, (StepItem("a", 3, False), StepItem("b", 1, False))))
    meter.on_finish(_finish("a", cached_tokens=4, first_token_at=995.0))
    meter.on_finish(_finish("b"))
    a, b = meter.take_record("a"), meter.take_record("b")
    assert a.gpu_seconds == pytest.approx(0.3) and b.gpu_seconds == pytest.approx(0.1)
    assert (a.tenant, a.tier, a.adapter, a.queued_at, a.first_token_at) == ("acme", "premium", "sql", 990.0, 995.0)
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens, a.status) == (10, 4, 5, "ok")


def test_recompute_is_charged_to_the_preempting_tier():
    meter = UsageMeter()
    meter.begin("victim", "beta", "standard")
    meter.on_step(StepEvent(1.0, (StepItem("victim", 8, True, "premium"), StepItem("victim2", 8, True, None))))
    meter.begin("victim2", "beta", "standard")
    meter.on_step(StepEvent(0.5, (StepItem("victim", 4, False),)))
    meter.on_finish(_finish("victim"))
    meter.on_finish(_finish("victim2"))
    victim = meter.take_record("victim")
    assert victim.gpu_seconds == pytest.approx(0.5)
    assert victim.recompute_by_tier == pytest.approx({"premium": 0.5})
    # With no payer named, the request's own tier pays.
    assert meter.take_record("victim2").recompute_by_tier == pytest.approx({"standard": 0.5})


def test_mixed_run_conserves_busy_time():
    rng = random.Random(7)
    meter = UsageMeter()
    requests = [f"r{i}" for i in range(40)]
    for rid in requests:
        meter.begin(rid, f"t{rng.randrange(4)}", rng.choice(["premium", "standard"]))
    live = set(requests)
    records = []
    while live:
        batch = rng.sample(sorted(live), min(len(live), rng.randint(1, 6)))
        items = tuple(
            StepItem(rid, rng.randint(0, 64), rng.random() < 0.2, rng.choice(["premium", "standard", None]))
            for rid in batch
        )
        meter.on_step(StepEvent(rng.uniform(0.001, 0.05), items))
        for rid in batch:
            if rng.random() < 0.3:
                live.discard(rid)
                meter.on_finish(_finish(rid, status=rng.choice(["ok", "cancelled", "error"])))
                records.append(meter.take_record(rid))
    billed = sum(r.gpu_seconds + r.recompute_gpu_seconds for r in records)
    assert billed == pytest.approx(meter.busy_seconds, rel=1e-9)


def test_unknown_engine_status_is_recorded_as_error():
    meter = UsageMeter()
    meter.begin("a", "acme", "standard")
    meter.on_finish(_finish("a", status="exploded"))
    assert meter.take_record("a").status == "error"


def test_rejected_request_costs_nothing_but_is_recorded():
    meter = UsageMeter()
    meter.begin("a", "acme", "standard")
    record = meter.record_rejected("a", "acme", "standard", "sql", queued_at=5.0)
    assert (record.status, record.gpu_seconds, record.recompute_gpu_seconds, record.adapter) == ("rejected", 0, 0, "sql")


def test_requests_never_begun_are_recorded_for_the_periodic_flush():
    meter = UsageMeter()
    meter.begin("mine", "acme", "standard")
    meter.on_step(StepEvent(0.2, (StepItem("warmup", 4, False), StepItem("mine", 4, False))))
    meter.on_finish(_finish("warmup", tier="premium", adapter="sql", queued_at=999.0))
    meter.on_finish(_finish("mine"))
    [orphan] = meter.pop_unclaimed()
    assert (orphan.request_id, orphan.tenant, orphan.tier, orphan.adapter) == ("warmup", None, "premium", "sql")
    assert orphan.gpu_seconds == pytest.approx(0.1)
    assert meter.take_record("mine").tenant == "acme"


def test_compute_charged_outside_steps_is_billed_to_its_request_admitted_or_refused():
    meter = UsageMeter()
    meter.charge("a", 0.25)  # its grammar's compile, before the engine has it
    meter.begin("a", "acme", "standard")
    meter.on_step(StepEvent(0.4, (StepItem("a", 1, False),)))
    meter.on_finish(_finish("a"))
    assert meter.take_record("a").gpu_seconds == pytest.approx(0.65)
    meter.charge("r", 5.0)  # a compile killed at its budget: the request is refused, its sender still pays
    assert meter.record_rejected("r", "acme", "standard").gpu_seconds == pytest.approx(5.0)
    assert meter.charged_seconds == pytest.approx(5.25) and meter.busy_seconds == pytest.approx(0.4)
