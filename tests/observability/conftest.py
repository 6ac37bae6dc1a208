"""Fixtures of the observability tests: a metrics instance and an engine-state double for scrape-time reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.metrics import GatewayMetrics
from gateway.tracing import Tracing
from scheduler.load import TierLoad
from tests.observability.live_gateway import LiveGateway, live_gateway

# Tenants of the shared live gateway; tests read metrics as differences, so they may share it.
TENANTS = {
    "acme": {"tier": "premium"},
    "bulk": {"tier": "standard"},
    "tiny": {"tier": "standard", "rpm": 2},
}


@dataclass
class LoraPoolCounters:
    loads: int = 0
    cache_hits: int = 0


@dataclass
class EngineState:
    """What the engine reports at scrape time, set by the test (the real engine is exercised in the e2e tests)."""

    loads: dict[str, TierLoad] = field(default_factory=dict)
    used_blocks: dict[str, int] = field(default_factory=dict)
    num_blocks: int = 0
    lora_pool: LoraPoolCounters = field(default_factory=LoraPoolCounters)
    spread: dict[str, float] = field(default_factory=dict)

    def load(self) -> dict[str, TierLoad]:
        return dict(self.loads)

    def kv_usage(self) -> tuple[dict[str, int], int]:
        return dict(self.used_blocks), self.num_blocks

    def fair_share_spread(self) -> dict[str, float]:
        return dict(self.spread)


@pytest.fixture
def metrics() -> GatewayMetrics:
    return GatewayMetrics()


@pytest.fixture
def engine_state() -> EngineState:
    return EngineState(
        loads={"premium": TierLoad(1, 2, 0.25), "standard": TierLoad(5, 3, 4.0)},
        used_blocks={"premium": 12, "standard": 50},
        num_blocks=100,
        lora_pool=LoraPoolCounters(loads=3, cache_hits=17),
        spread={"standard": 120.0},
    )


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="session")
def gateway(tmp_path_factory, span_exporter) -> LiveGateway:
    """The real app over a tiny random Llama, its spans kept in ``span_exporter``."""
    with live_gateway(tmp_path_factory.mktemp("gateway"), TENANTS, tracing=Tracing(span_exporter)) as gw:
        yield gw
