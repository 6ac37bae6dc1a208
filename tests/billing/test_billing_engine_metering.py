"""The must-show on a real engine run: the ledger's GPU-seconds add up to the engine's busy time, and
recompute after a preemption lands on the tier that preempted.

A tiny dummy-weight Llama and a pool too small for the batch force preemptions.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from transformers import LlamaConfig

from billing.db import create_engine_for
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.reports import usage_report
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import StepEvent, listener
from engine.request import EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ).save_pretrained(folder)
    engine = Engine(EngineConfig(
        model=f"dummy:{folder}", block_size=4, num_kv_blocks=40, max_num_seqs=16,
        max_num_batched_tokens=64, max_loras=0, cache_dir=str(folder / "cache"),
        enable_prefix_caching=False,
    )).start()
    yield engine
    engine.shutdown()


def _requests(prefix: str, tier: str, n: int, prompt_len: int) -> list[EngineRequest]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [EngineRequest(f"{prefix}{i}", [5 + (i * 7 + j) % 300 for j in range(prompt_len)], params, tier)
            for i in range(n)]


@pytest.mark.postgres
def test_engine_run_bills_busy_time_and_charges_recompute_to_its_payer(tiny_engine, pg_url_migrated, tmp_path):
    engine = create_engine_for(pg_url_migrated)
    meter = UsageMeter()
    standard_running = threading.Event()
    expected_recompute: dict[str, float] = defaultdict(float)
    tiers: dict[str, str] = {}

    def watch_recompute(event) -> None:
        if isinstance(event, StepEvent):
            standard_running.set()
            total = sum(item.tokens for item in event.items)
            for item in event.items:
                if item.is_recompute:
                    payer = item.recompute_charged_tier or tiers[item.request_id]
                    expected_recompute[payer] += event.duration_s * item.tokens / total

    standard = _requests("s", "standard", 8, 20)
    premium = _requests("p", "premium", 4, 24)
    for request in standard + premium:
        tiers[request.request_id] = request.tier
        meter.begin(request.request_id, f"tenant-{request.tier}", request.tier)
    busy_before = tiny_engine.busy_seconds
    tiny_engine.add_listener(listener(meter.on_step, meter.on_finish))
    tiny_engine.add_listener(watch_recompute)
    # Standard requests fill the pool first; premium ones arriving later preempt them.
    runner = threading.Thread(target=tiny_engine.generate_batch_sync, args=(standard,))
    runner.start()
    assert standard_running.wait(60)
    tiny_engine.generate_batch_sync(premium)
    runner.join()

    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    for request in standard + premium:
        ledger.write(meter.take_record(request.request_id))
    now = datetime.now(UTC)
    rows = usage_report(engine, now - timedelta(hours=1), now + timedelta(hours=1), "tier", "day")
    billed = sum(r.gpu_seconds + r.recompute_gpu_seconds for r in rows)
    busy = tiny_engine.busy_seconds - busy_before
    assert busy > 0 and billed == pytest.approx(busy, rel=0.01)
    recompute = {r.group: r.recompute_gpu_seconds for r in rows}
    assert recompute.get("premium", 0.0) > 0
    for tier in ("premium", "standard"):
        assert recompute.get(tier, 0.0) == pytest.approx(expected_recompute.get(tier, 0.0), abs=1e-9)
    assert sum(r.requests for r in rows) == 12
    engine.dispose()
