"""The endpoint picker's series: one each, read from the engine at scrape time, optionally under vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from gateway.epp_metrics import exported_names
from gateway.metrics import GatewayMetrics, render
from scheduler.config import default_tiers
from scheduler.load import TierLoad


@dataclass
class BusyEngine:
    loads: dict[str, TierLoad] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    adapters: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    config: EngineConfig = field(default_factory=lambda: EngineConfig(model="dummy:none", max_loras=3, block_size=16))

    def load(self) -> dict[str, TierLoad]:
        return self.loads

    def kv_usage(self) -> tuple[dict[str, int], int]:
        return self.used, 200

    def adapter_usage(self) -> tuple[frozenset[str], frozenset[str]]:
        return self.adapters


def scrape(metrics: GatewayMetrics) -> dict[str, list]:
    body, _ = render(metrics)
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def test_each_epp_series_is_one_sample_summed_over_tiers():
    engine = BusyEngine(loads={"premium": TierLoad(2, 3, 0.1), "standard": TierLoad(5, 1, 0.9)},
                        used={"premium": 30, "standard": 20}, adapters=(frozenset({"b", "a"}), frozenset({"c"})))
    metrics = GatewayMetrics(default_tiers())
    metrics.attach_engine(engine)
    families = scrape(metrics)
    for name in exported_names(vllm_names=False):
        assert len(families[name]) == 1, name
    assert families["tiergate_num_requests_waiting"][0].value == 7
    assert families["tiergate_num_requests_running"][0].value == 4
    assert families["tiergate_kv_cache_usage_perc"][0].value == 0.25
    lora = families["tiergate_lora_requests_info"][0].labels
    assert lora == {"max_lora": "3", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert families["tiergate_cache_config_info"][0].labels == {"block_size": "16", "num_gpu_blocks": "200"}
    assert families["tiergate_draining"][0].value == 0
    metrics.draining = True
    assert scrape(metrics)["tiergate_draining"][0].value == 1


def test_lora_info_timestamp_moves_only_when_the_adapter_sets_change():
    engine = BusyEngine(adapters=(frozenset({"a"}), frozenset()))
    metrics = GatewayMetrics(default_tiers())
    metrics.attach_engine(engine)
    first = scrape(metrics)["tiergate_lora_requests_info"][0].value
    assert scrape(metrics)["tiergate_lora_requests_info"][0].value == first
    engine.adapters = (frozenset({"a", "b"}), frozenset())
    assert scrape(metrics)["tiergate_lora_requests_info"][0].value >= first


def test_vllm_names_carry_the_same_values():
    engine = BusyEngine(loads={"premium": TierLoad(1, 2, 0.0)}, used={"premium": 50})
    metrics = GatewayMetrics(default_tiers(), vllm_names=True)
    metrics.attach_engine(engine)
    families = scrape(metrics)
    for own, vllm in (("tiergate_num_requests_waiting", "vllm:num_requests_waiting"),
                      ("tiergate_num_requests_running", "vllm:num_requests_running"),
                      ("tiergate_kv_cache_usage_perc", "vllm:kv_cache_usage_perc")):
        assert [s.value for s in families[vllm]] == [s.value for s in families[own]]
    assert families["vllm:lora_requests_info"][0].labels == families["tiergate_lora_requests_info"][0].labels


def test_batch_lines_waiting_are_not_counted_as_interactive_queue():
    engine = BusyEngine(loads={"premium": TierLoad(1, 0, 0.1), "standard": TierLoad(2, 0, 0.2),
                               "batch": TierLoad(500, 8, 90.0)})
    metrics = GatewayMetrics(default_tiers())
    metrics.attach_engine(engine)
    families = scrape(metrics)
    assert families["tiergate_num_requests_waiting"][0].value == 3
    assert families["tiergate_num_requests_running"][0].value == 8
