"""Metrics of a real engine run in which standard requests get preempted."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, StepEvent
from engine.request import EngineRequest, SamplingParams
from gateway.metrics import GatewayMetrics, render
from tests.observability.histograms import families
from tests.observability.live_gateway import write_tiny_llama

pytestmark = pytest.mark.slow


def sample(body: str, name: str, **labels: str) -> float:
    [found] = [s.value for f in families(body).values() for s in f.samples if s.name == name and s.labels == labels]
    return found


def test_preemptions_and_recompute_are_counted_for_the_right_tiers(tmp_path):
    config = write_tiny_llama(tmp_path / "tiny")
    # 12 blocks of 16 tokens: two standard requests growing to 88 tokens each cannot both stay resident.
    # No prefix cache: a victim preempted on a block boundary would find all it had computed cached
    # and recompute nothing, and whether it is depends on when the premium request lands.
    engine = Engine(EngineConfig(model=f"dummy:{config}", num_kv_blocks=12, max_loras=0, max_model_len=256,
                                 max_num_batched_tokens=64, enable_prefix_caching=False))
    metrics = GatewayMetrics(engine.config.tiers)
    events: list[StepEvent | FinishEvent] = []
    engine.add_listener(metrics.on_engine_event)
    engine.add_listener(events.append)
    metrics.attach_engine(engine)
    standard = [EngineRequest(f"s{i}", list(range(3, 43)), SamplingParams(max_tokens=48, ignore_eos=True), "standard")
                for i in range(2)]
    premium = EngineRequest("p0", list(range(3, 83)), SamplingParams(max_tokens=4, ignore_eos=True), "premium")
    with engine:
        background = threading.Thread(target=engine.generate_batch_sync, args=(standard,))
        background.start()
        deadline = time.monotonic() + 60
        while engine.kv_usage()[0].get("standard", 0) < 6:  # both standard prompts are in
            assert time.monotonic() < deadline, "standard requests never took their blocks"
            time.sleep(0.005)
        engine.generate_batch_sync([premium])
        background.join()
    body = render(metrics)[0].decode()

    finishes = [e for e in events if isinstance(e, FinishEvent)]
    assert {f.request_id: f.status for f in finishes} == {"s0": "ok", "s1": "ok", "p0": "ok"}
    steps = [e for e in events if isinstance(e, StepEvent)]
    preempted = {tier: sum(t == tier for s in steps for _, t in s.preempted) for tier in ("premium", "standard")}
    assert preempted["standard"] > 0
    for tier, count in preempted.items():
        assert sample(body, "tiergate_preemptions_total", tier=tier) == count
    recompute = [i for e in events if isinstance(e, StepEvent) for i in e.items if i.is_recompute]
    assert recompute, "a preempted request recomputes its tokens"
    for tier in ("premium", "standard"):
        charged = sum(i.tokens for i in recompute if i.recompute_charged_tier == tier)
        assert sample(body, "tiergate_tokens_total", tier=tier, kind="recompute") == charged
    gpu_seconds = sum(sample(body, "tiergate_gpu_seconds_total", tier=t) for t in ("premium", "standard"))
    assert gpu_seconds == pytest.approx(engine.busy_seconds, rel=1e-9)
    assert sample(body, "tiergate_kv_blocks_used", tier="standard") == 0
