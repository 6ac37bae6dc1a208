"""The endpoint picker's model-server protocol on /metrics: one series per name, read at scrape time.

The Gateway API Inference Extension's endpoint picker (EPP) scores each pod
from a handful of single series (queue, running batch, KV-cache use, LoRA
adapters, cache geometry); the per-tier metrics of gateway/metrics.py stay
for dashboards. With ``vllm_names`` the same values are also exported under
vLLM's names, so an EPP, KEDA or HPA configured for vLLM works unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# (tiergate name, vLLM name); the draining flag has no vLLM counterpart.
WAITING = ("tiergate_num_requests_waiting", "vllm:num_requests_waiting")
RUNNING = ("tiergate_num_requests_running", "vllm:num_requests_running")
KV_USAGE = ("tiergate_kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
LORA_INFO = ("tiergate_lora_requests_info", "vllm:lora_requests_info")
CACHE_INFO = ("tiergate_cache_config_info", "vllm:cache_config_info")
DRAINING = "tiergate_draining"


def exported_names(vllm_names: bool) -> list[str]:
    """Every EPP series name this collector exports with the given setting."""
    pairs = (WAITING, RUNNING, KV_USAGE, LORA_INFO, CACHE_INFO)
    return [own for own, _ in pairs] + [DRAINING] + ([vllm for _, vllm in pairs] if vllm_names else [])


class EndpointPickerCollector(Collector):
    """Reads the engine (and the drain flag) each scrape; every family holds exactly one series."""

    def __init__(self, engine: Any, draining: Callable[[], bool], vllm_names: bool = False) -> None:
        self.engine = engine
        self.draining = draining
        self.vllm_names = vllm_names
        # lora_requests_info's value is when its adapter sets last changed (vLLM's convention).
        self._lora_state: tuple[str, str] | None = None
        self._lora_changed_at = time.time()

    def describe(self) -> list[Any]:
        return list(self._families(None))

    def collect(self) -> Iterator[Any]:
        return iter(self._families(self.engine))

    def _families(self, engine: Any) -> list[Any]:
        out: list[Any] = []
        draining = GaugeMetricFamily(DRAINING, "1 while this replica drains (SIGTERM): it takes no new requests.")
        out.append(draining)
        if engine is None:
            for names in (WAITING, RUNNING, KV_USAGE, LORA_INFO, CACHE_INFO):
                out.extend(GaugeMetricFamily(n, "") for n in self._names(names))
            return out
        draining.add_metric([], 1.0 if self.draining() else 0.0)
        # Spare-capacity (batch) work is no queue an interactive request would wait behind: not "waiting".
        spare = {t.name for t in getattr(getattr(engine, "config", None), "tiers", ()) if t.spare_only}
        by_tier = engine.load()
        queued = sum(t.queue_depth for name, t in by_tier.items() if name not in spare)
        load = by_tier.values()
        used_by_tier, num_blocks = engine.kv_usage()
        running_adapters, waiting_adapters = _adapter_usage(engine)
        # A stand-in engine of a test may lack a config; the real one always has it.
        config = getattr(engine, "config", None)
        max_loras, block_size = getattr(config, "max_loras", 0), getattr(config, "block_size", 0)
        lora_labels = (str(max_loras), ",".join(sorted(running_adapters)), ",".join(sorted(waiting_adapters)))
        if lora_labels[1:] != self._lora_state:
            self._lora_state = lora_labels[1:]
            self._lora_changed_at = time.time()
        for names in self._pairs():
            waiting_name, running_name, kv_name, lora_name, cache_name = names
            out.append(_gauge(waiting_name, "Requests waiting for their first step, every tier but batch.", queued))
            out.append(_gauge(running_name, "Requests in the running batch, all tiers.", sum(t.running for t in load)))
            out.append(_gauge(kv_name, "Fraction of KV-cache blocks in use, 0 to 1.",
                              min(1.0, sum(used_by_tier.values()) / num_blocks) if num_blocks else 0.0))
            lora = GaugeMetricFamily(lora_name, "LoRA adapters of running and waiting requests; value: when they "
                                     "last changed.", labels=["max_lora", "running_lora_adapters",
                                                              "waiting_lora_adapters"])
            lora.add_metric(list(lora_labels), self._lora_changed_at)
            out.append(lora)
            cache = GaugeMetricFamily(cache_name, "KV-cache geometry; value 1.", labels=["block_size", "num_gpu_blocks"])
            cache.add_metric([str(block_size), str(num_blocks)], 1.0)
            out.append(cache)
        return out

    def _pairs(self) -> list[tuple[str, ...]]:
        pairs = (WAITING, RUNNING, KV_USAGE, LORA_INFO, CACHE_INFO)
        names = [tuple(own for own, _ in pairs)]
        if self.vllm_names:
            names.append(tuple(vllm for _, vllm in pairs))
        return names

    def _names(self, pair: tuple[str, str]) -> list[str]:
        return [pair[0], pair[1]] if self.vllm_names else [pair[0]]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _adapter_usage(engine: Any) -> tuple[frozenset[str], frozenset[str]]:
    usage = getattr(engine, "adapter_usage", None)
    return usage() if usage is not None else (frozenset(), frozenset())
