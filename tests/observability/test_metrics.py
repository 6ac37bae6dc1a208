"""GatewayMetrics read back through prometheus-client's parser: names, labels, and values that match what was fed."""

from __future__ import annotations

import pytest

from engine.events import FinishEvent, StepEvent, StepItem
from gateway.metrics import REJECTION_REASONS, REQUEST_STATUSES, TOKEN_KINDS, GatewayMetrics, render
from tests.observability.histograms import buckets, families

# name -> (type, label names) of every metric DESIGN.md and the dashboard rely on
EXPECTED = {
    "tiergate_ttft_seconds": ("histogram", {"tier"}),
    "tiergate_tpot_seconds": ("histogram", {"tier"}),
    "tiergate_inter_token_seconds": ("histogram", {"tier"}),
    "tiergate_step_seconds": ("histogram", set()),
    "tiergate_queue_depth": ("gauge", {"tier"}),
    "tiergate_running_requests": ("gauge", {"tier"}),
    "tiergate_predicted_ttft_seconds": ("gauge", {"tier"}),
    "tiergate_kv_blocks_used": ("gauge", {"tier"}),
    "tiergate_kv_blocks_total": ("gauge", set()),
    "tiergate_kv_blocks_reserved": ("gauge", {"tier"}),
    "tiergate_ttft_slo_seconds": ("gauge", {"tier"}),
    "tiergate_preemptions": ("counter", {"tier"}),
    "tiergate_requests": ("counter", {"tier", "status"}),
    "tiergate_rejections": ("counter", {"tier", "reason"}),
    "tiergate_gpu_seconds": ("counter", {"tier"}),
    "tiergate_tokens": ("counter", {"tier", "kind"}),
    "tiergate_adapter_loads": ("counter", set()),
    "tiergate_adapter_cache_hits": ("counter", set()),
    "tiergate_fair_share_counter_spread": ("gauge", {"tier"}),
    "tiergate_spec_decode_draft_tokens": ("counter", set()),
    "tiergate_spec_decode_accepted_tokens": ("counter", set()),
}


def scrape(metrics: GatewayMetrics) -> str:
    body, content_type = render(metrics)
    assert content_type.startswith("text/plain; version=0.0.4")
    return body.decode()


def value(body: str, sample_name: str, **labels: str) -> float:
    matches = [
        s.value
        for family in families(body).values()
        for s in family.samples
        if s.name == sample_name and s.labels == labels
    ]
    assert len(matches) == 1, f"{sample_name}{labels}: {matches}"
    return matches[0]


def test_every_design_metric_is_exposed_with_its_labels_and_no_tenant(metrics, engine_state):
    metrics.attach_engine(engine_state)
    parsed = families(scrape(metrics))
    for name, (kind, label_names) in EXPECTED.items():
        assert name in parsed, name
        assert parsed[name].type == kind, name
        for sample in parsed[name].samples:
            if sample.name.endswith("_created"):
                continue
            assert set(sample.labels) - {"le"} == label_names, (sample.name, sample.labels)
    assert not any("tenant" in s.labels for f in parsed.values() for s in f.samples)


def test_every_label_combination_exists_at_zero_before_traffic(metrics):
    body = scrape(metrics)
    for tier in ("premium", "standard"):
        for status in REQUEST_STATUSES:
            assert value(body, "tiergate_requests_total", tier=tier, status=status) == 0
        for reason in REJECTION_REASONS:
            assert value(body, "tiergate_rejections_total", tier=tier, reason=reason) == 0
        for kind in TOKEN_KINDS:
            assert value(body, "tiergate_tokens_total", tier=tier, kind=kind) == 0
        assert value(body, "tiergate_ttft_seconds_count", tier=tier) == 0


def test_ttft_observations_land_in_their_buckets(metrics):
    for seconds in (0.004, 0.35, 0.45, 12.0):
        metrics.observe_ttft("premium", seconds)
    metrics.observe_ttft("standard", 2.5)
    body = scrape(metrics)
    premium = dict(buckets(body, "tiergate_ttft_seconds", tier="premium"))
    assert premium[0.005] == 1
    assert premium[0.4] == 2
    assert premium[0.5] == 3
    assert premium[10.0] == 3
    assert premium[float("inf")] == 4
    assert value(body, "tiergate_ttft_seconds_sum", tier="premium") == pytest.approx(12.804)
    assert value(body, "tiergate_ttft_seconds_count", tier="standard") == 1


def test_tpot_buckets_resolve_gpu_and_cpu_speeds(metrics):
    metrics.observe_tpot("premium", 0.004)  # a GPU's few milliseconds
    metrics.observe_tpot("premium", 0.12)  # this CPU's 100+ ms
    cumulative = dict(buckets(scrape(metrics), "tiergate_tpot_seconds", tier="premium"))
    assert cumulative[0.0025] == 0 and cumulative[0.005] == 1
    assert cumulative[0.1] == 1 and cumulative[0.15] == 2


def test_requests_and_rejections_are_counted_by_tier_status_and_reason(metrics):
    metrics.count_request("premium", "ok")
    metrics.count_request("premium", "ok")
    metrics.count_request("standard", "cancelled")
    metrics.count_rejection("standard", "slo")
    metrics.count_rejection("standard", "rpm")
    metrics.count_rejection("standard", "rpm")
    body = scrape(metrics)
    assert value(body, "tiergate_requests_total", tier="premium", status="ok") == 2
    assert value(body, "tiergate_requests_total", tier="standard", status="cancelled") == 1
    assert value(body, "tiergate_rejections_total", tier="standard", reason="rpm") == 2
    assert value(body, "tiergate_rejections_total", tier="standard", reason="slo") == 1
    assert value(body, "tiergate_rejections_total", tier="premium", reason="rpm") == 0


def test_step_time_is_split_by_token_share_and_recompute_is_charged_to_the_preempting_tier(metrics):
    step = StepEvent(
        duration_s=0.2,
        items=(
            StepItem("p1", 30, False, tier="premium"),
            StepItem("s1", 10, False),
            StepItem("s2", 60, True, recompute_charged_tier="premium"),
        ),
    )
    metrics.on_engine_event(step)
    body = scrape(metrics)
    assert value(body, "tiergate_gpu_seconds_total", tier="premium") == pytest.approx(0.2 * 90 / 100)
    assert value(body, "tiergate_gpu_seconds_total", tier="standard") == pytest.approx(0.2 * 10 / 100)
    assert value(body, "tiergate_tokens_total", tier="premium", kind="recompute") == 60
    assert value(body, "tiergate_tokens_total", tier="standard", kind="recompute") == 0
    assert value(body, "tiergate_step_seconds_count") == 1
    assert value(body, "tiergate_step_seconds_sum") == pytest.approx(0.2)


def test_steps_count_preemptions_and_finish_counts_tokens(metrics):
    metrics.on_engine_event(StepEvent(0.1, (StepItem("s1", 8, False),), preempted=(("s1", "standard"),)))
    metrics.on_engine_event(StepEvent(0.0, (), preempted=(("s1", "standard"),)))
    finish = FinishEvent(
        "s1", prompt_tokens=8, completion_tokens=5, status="ok", cached_tokens=3, tier="standard"
    )
    metrics.on_engine_event(finish)
    # A request's last step may be reported after its finish: it still counts for its tier.
    metrics.on_engine_event(StepEvent(0.1, (StepItem("s1", 1, False),)))
    body = scrape(metrics)
    assert value(body, "tiergate_tokens_total", tier="standard", kind="prompt") == 8
    assert value(body, "tiergate_tokens_total", tier="standard", kind="completion") == 5
    assert value(body, "tiergate_tokens_total", tier="standard", kind="cached") == 3
    assert value(body, "tiergate_preemptions_total", tier="standard") == 2
    assert value(body, "tiergate_gpu_seconds_total", tier="standard") == pytest.approx(0.2)
    assert value(body, "tiergate_step_seconds_count") == 3


def test_steps_of_requests_from_outside_the_gateway_count_for_their_tier_like_any(metrics):
    metrics.on_engine_event(StepEvent(0.5, (StepItem("bench-1", 16, False, tier="premium"),)))
    body = scrape(metrics)
    assert value(body, "tiergate_step_seconds_count") == 1
    assert value(body, "tiergate_gpu_seconds_total", tier="premium") == pytest.approx(0.5)
    assert value(body, "tiergate_gpu_seconds_total", tier="standard") == 0


def test_scrape_reads_queue_kv_reserve_and_adapter_counters_from_the_engine(metrics, engine_state):
    metrics.attach_engine(engine_state)
    body = scrape(metrics)
    assert value(body, "tiergate_queue_depth", tier="standard") == 5
    assert value(body, "tiergate_running_requests", tier="premium") == 2
    assert value(body, "tiergate_predicted_ttft_seconds", tier="standard") == 4.0
    assert value(body, "tiergate_kv_blocks_used", tier="premium") == 12
    assert value(body, "tiergate_kv_blocks_total") == 100
    assert value(body, "tiergate_kv_blocks_reserved", tier="premium") == 30  # default premium reserve: 30%
    assert value(body, "tiergate_kv_blocks_reserved", tier="standard") == 0
    assert value(body, "tiergate_ttft_slo_seconds", tier="premium") == 0.5
    assert value(body, "tiergate_adapter_loads_total") == 3
    assert value(body, "tiergate_adapter_cache_hits_total") == 17
    assert value(body, "tiergate_fair_share_counter_spread", tier="standard") == 120.0
    assert value(body, "tiergate_fair_share_counter_spread", tier="premium") == 0.0
    # Read at every scrape, never cached.
    engine_state.used_blocks["premium"] = 20
    engine_state.lora_pool.cache_hits = 18
    body = scrape(metrics)
    assert value(body, "tiergate_kv_blocks_used", tier="premium") == 20
    assert value(body, "tiergate_adapter_cache_hits_total") == 18


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_ttft("tenant-acme", 0.1),
        lambda m: m.count_request("premium", "teapot"),
        lambda m: m.count_rejection("premium", "because"),
        lambda m: m.count_tokens("premium", "images", 1),
        lambda m: m.count_tokens("premium", "prompt", -1),
    ],
)
def test_label_values_outside_the_closed_sets_are_refused(metrics, call):
    with pytest.raises(ValueError):
        call(metrics)
    # And nothing new appeared in the exposition.
    assert "tenant-acme" not in scrape(metrics) and "gold" not in scrape(metrics)


def test_each_app_instance_has_its_own_registry():
    first, second = GatewayMetrics(), GatewayMetrics()
    first.count_request("premium", "ok")
    assert value(scrape(second), "tiergate_requests_total", tier="premium", status="ok") == 0
    assert value(scrape(first), "tiergate_requests_total", tier="premium", status="ok") == 1


def test_speculative_decoding_counts_drafted_and_accepted_tokens_from_step_events():
    metrics = GatewayMetrics()
    item = StepItem("r", 5, False, tier="standard")
    metrics.on_engine_event(StepEvent(duration_s=0.1, items=(item,), draft_tokens=4, accepted_tokens=3))
    metrics.on_engine_event(StepEvent(duration_s=0.1, items=(item,), draft_tokens=4, accepted_tokens=1))
    metrics.on_engine_event(StepEvent(duration_s=0.1, items=(item,)))
    body = scrape(metrics)
    assert value(body, "tiergate_spec_decode_draft_tokens_total") == 8
    assert value(body, "tiergate_spec_decode_accepted_tokens_total") == 4
