"""A real Prometheus server scrapes a live /metrics under traffic; ttft_p99_premium is read back over its API."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from tests.observability.histograms import buckets, histogram_quantile
from tests.observability.live_gateway import complete, live_gateway, stream_chat
from tests.observability.prometheus_server import start_prometheus

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "prometheus" / "rules.yml"

pytestmark = pytest.mark.slow


def prometheus_value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def close_to(expected: float):
    return lambda result: len(result) == 1 and math.isclose(prometheus_value(result), expected, rel_tol=1e-9)


def test_prometheus_scrapes_a_live_gateway_under_traffic_and_records_ttft_p99_premium(tmp_path):
    tenants = {"acme": {"tier": "premium"}, "bulk": {"tier": "standard"}}
    with live_gateway(tmp_path / "gateway", tenants) as gateway:
        (tmp_path / "prometheus").mkdir()
        prometheus = start_prometheus(tmp_path / "prometheus", gateway.target, [RULES])
        try:
            prometheus.wait_for('tiergate_ttft_seconds_count{tier="premium"} == 0')
            with gateway.client("acme") as acme, gateway.client("bulk") as bulk:
                for i in range(6):
                    stream_chat(acme, gateway.model, f"premium question {i}", max_tokens=4)
                    assert complete(bulk, gateway.model, f"standard prompt {i}", max_tokens=4).status_code == 200
            body = httpx.get(f"{gateway.url}/metrics").text
            expected = histogram_quantile(0.99, buckets(body, "tiergate_ttft_seconds", tier="premium"))
            assert expected > 0
            result = prometheus.wait_for("ttft_p99_premium", predicate=close_to(expected))
            assert prometheus_value(result) == pytest.approx(expected)
            prometheus.wait_for('tiergate_requests_total{tier="premium",status="ok"} == 6')
            # The alert needs five minutes over 0.4 s; a fast tiny model never gets there.
            assert prometheus.query('ALERTS{alertname="PremiumTTFTP99High",alertstate="firing"}') == []
        finally:
            prometheus.stop()
