"""Real traffic through the real app; /metrics read through prometheus-client's parser must match what was sent."""

from __future__ import annotations

import pytest

from tests.observability.histograms import families
from tests.observability.live_gateway import complete, stream_chat

pytestmark = pytest.mark.slow


def sample(parsed: dict, name: str, **labels: str) -> float:
    found = [s.value for f in parsed.values() for s in f.samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def scrape(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return families(response.text)


def test_metrics_match_the_traffic_sent(gateway):
    usages: dict[str, list[dict]] = {"premium": [], "standard": []}
    busy_before = gateway.engine.busy_seconds
    with gateway.client("acme") as acme, gateway.client("bulk") as bulk, gateway.client("tiny") as tiny:
        before = scrape(acme)
        for i in range(4):
            usages["premium"].append(stream_chat(acme, gateway.model, f"premium question {i}", max_tokens=3 + i))
        for i in range(3):
            response = complete(bulk, gateway.model, f"standard prompt number {i}", max_tokens=4)
            assert response.status_code == 200, response.text
            usages["standard"].append(response.json()["usage"])
        responses = [complete(tiny, gateway.model, "hi", max_tokens=2) for _ in range(3)]
        assert [r.status_code for r in responses] == [200, 200, 429]  # rpm=2
        usages["standard"] += [r.json()["usage"] for r in responses[:2]]
        after = scrape(tiny)

    def sent_since(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    for tier, sent in usages.items():
        assert sent_since("tiergate_requests_total", tier=tier, status="ok") == len(sent)
        assert sent_since("tiergate_requests_total", tier=tier, status="error") == 0
        assert sent_since("tiergate_ttft_seconds_count", tier=tier) == len(sent)
        multi_token = [u for u in sent if u["completion_tokens"] > 1]
        assert sent_since("tiergate_tpot_seconds_count", tier=tier) == len(multi_token)
        # One token a delta here: every token after a request's first ends one gap.
        gaps = sum(u["completion_tokens"] - 1 for u in multi_token)
        assert sent_since("tiergate_inter_token_seconds_count", tier=tier) == gaps
        assert sent_since("tiergate_tokens_total", tier=tier, kind="prompt") == sum(u["prompt_tokens"] for u in sent)
        assert sent_since("tiergate_tokens_total", tier=tier, kind="completion") == sum(
            u["completion_tokens"] for u in sent
        )
        assert sent_since("tiergate_tokens_total", tier=tier, kind="recompute") == 0
        assert sent_since("tiergate_preemptions_total", tier=tier) == 0
        assert sent_since("tiergate_gpu_seconds_total", tier=tier) > 0
    assert sent_since("tiergate_rejections_total", tier="standard", reason="rpm") == 1
    assert sent_since("tiergate_rejections_total", tier="premium", reason="rpm") == 0

    # Every step served these requests only, so the tiers' GPU-seconds add up to the engine's busy time.
    busy = gateway.engine.busy_seconds - busy_before
    gpu_seconds = sum(sent_since("tiergate_gpu_seconds_total", tier=t) for t in usages)
    assert gpu_seconds == pytest.approx(busy, rel=1e-6)
    assert sent_since("tiergate_step_seconds_sum") == pytest.approx(busy, rel=1e-6)
    assert sent_since("tiergate_step_seconds_count") > 0

    # Scrape-time engine state: everything finished, nothing queued or holding KV blocks.
    num_blocks = gateway.engine.num_kv_blocks
    assert sample(after, "tiergate_kv_blocks_total") == num_blocks
    assert sample(after, "tiergate_kv_blocks_reserved", tier="premium") == int(num_blocks * 0.30)
    for tier in usages:
        assert sample(after, "tiergate_queue_depth", tier=tier) == 0
        assert sample(after, "tiergate_kv_blocks_used", tier=tier) == 0
    assert not any("tenant" in s.labels for f in after.values() for s in f.samples)
