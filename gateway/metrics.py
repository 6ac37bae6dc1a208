"""Prometheus metrics of one gateway app: the names of DESIGN.md, in a registry of its own.

Who feeds what:
- the gateway's request path: ``observe_ttft``, ``observe_tpot`` (a request's mean),
  ``observe_inter_token`` (each gap a stream's client waits between two deltas: the latency
  bound of scheduler/step_budget.py is judged on its p99), ``count_request``, ``count_rejection``;
- the engine thread, through ``engine.add_listener(metrics.on_engine_event)``:
  step time, GPU-seconds and tokens per tier (the tiers the step's items carry), preemptions;
- scrape time, once ``attach_engine(engine)`` was called: queue depth, KV blocks
  used per tier, the pool size and each tier's reserve, adapter loads and hits,
  and the endpoint picker's single series (gateway/epp_metrics.py), whose
  ``tiergate_draining`` reads ``self.draining``.

No label carries a tenant: tenants live in the billing ledger, and a per-tenant
label would grow the series count without bound. Every label value is checked
against a closed set for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.events import EngineEvent, FinishEvent, StepEvent
from gateway.epp_metrics import EndpointPickerCollector
from gateway.batch_metrics import BatchMetrics
from scheduler.config import TierConfig, default_tiers
from scheduler.load import TierLoad

# Bucket bounds cover a GPU (milliseconds) and this CPU (seconds to tens of
# seconds) in one histogram; 0.4 and 0.5 are bounds so that the premium alert
# (0.4 s) and SLO (0.5 s) read off exact bucket edges instead of interpolation.
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
)  # fmt: skip
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip

# Requests that reached the engine; refused ones are tiergate_rejections_total.
# interrupted: still running at a drain's deadline, ended by the server's shutdown.
REQUEST_STATUSES = ("ok", "cancelled", "error", "interrupted")
# rpm/tpm/concurrency: the tenant's rate limits; slo: predicted TTFT over the
# tier's SLO (admission control); overload: the engine's queue is full; budget: a tenant's spend limit.
REJECTION_REASONS = ("rpm", "tpm", "concurrency", "slo", "overload", "budget")
TOKEN_KINDS = ("prompt", "completion", "cached", "recompute")


class EngineLike(Protocol):
    """What ``attach_engine`` reads at scrape time (the Engine front of the preamble)."""

    def load(self) -> dict[str, TierLoad]: ...

    def kv_usage(self) -> tuple[dict[str, int], int]: ...


class GatewayMetrics:
    """All tiergate metrics of one app instance, registered in ``self.registry``."""

    def __init__(self, tiers: Sequence[TierConfig] | None = None, vllm_names: bool = False) -> None:
        self.vllm_names = vllm_names
        self.draining = False  # set by the app when a drain starts
        self.tiers: tuple[TierConfig, ...] = tuple(tiers) if tiers is not None else default_tiers()
        self.tier_names = tuple(t.name for t in self.tiers)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "tiergate_ttft_seconds",
            "Time from request arrival to its first token, as the client sees it.",
            ["tier"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tiergate_tpot_seconds",
            "Mean time per output token after the first, one sample per request.",
            ["tier"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tiergate_inter_token_seconds",
            "Time between two consecutive token deltas of one choice, as the gateway hands them out; one sample per gap.",
            ["tier"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "tiergate_step_seconds",
            "Duration of one engine step (forward pass and sampling).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batches = BatchMetrics(r)  # the Batch API's lines and batches
        self.requests = Counter("tiergate_requests", "Finished requests.", ["tier", "status"], registry=r)
        self.rejections = Counter(
            "tiergate_rejections", "Requests refused before reaching the engine.", ["tier", "reason"], registry=r
        )
        self.preemptions = Counter(
            "tiergate_preemptions", "Times a running request of this tier was preempted.", ["tier"], registry=r
        )
        self.gpu_seconds = Counter(
            "tiergate_gpu_seconds",
            "Engine step time split across requests by token share; recompute charged to the preempting tier.",
            ["tier"],
            registry=r,
        )
        self.tokens = Counter("tiergate_tokens", "Tokens by tier and kind.", ["tier", "kind"], registry=r)
        # Speculative decoding (engine/speculative.py), as vLLM's spec_decode counters: their ratio is the
        # acceptance rate.
        self.spec_draft_tokens = Counter("tiergate_spec_decode_draft_tokens", "Tokens drafted for verification.",
                                         registry=r)
        self.spec_accepted_tokens = Counter("tiergate_spec_decode_accepted_tokens",
                                            "Drafted tokens the model accepted.", registry=r)
        # The SLO as a series, so dashboards draw each tier's line from config rather than a constant.
        self.ttft_slo = Gauge("tiergate_ttft_slo_seconds", "The tier's time-to-first-token SLO.", ["tier"], registry=r)
        self._engine_collector: _EngineStateCollector | None = None
        self._epp_collector: EndpointPickerCollector | None = None
        self._children: dict[tuple, Any] = {}  # (metric id, label values) -> series; keys are closed sets
        self._create_series()

    def _create_series(self) -> None:
        # Every series exists at 0 from the start: rate() over a series that
        # appears mid-window misses its first increments.
        for tier_config in self.tiers:
            if tier_config.ttft_slo_s is not None:
                self.ttft_slo.labels(tier_config.name).set(tier_config.ttft_slo_s)
        for tier in self.tier_names:
            self.ttft.labels(tier)
            self.tpot.labels(tier)
            self.inter_token.labels(tier)
            self.preemptions.labels(tier)
            self.gpu_seconds.labels(tier)
            for status in REQUEST_STATUSES:
                self.requests.labels(tier, status)
            for reason in REJECTION_REASONS:
                self.rejections.labels(tier, reason)
            for kind in TOKEN_KINDS:
                self.tokens.labels(tier, kind)

    # -- the gateway's request path --------------------------------------

    def observe_ttft(self, tier: str, seconds: float) -> None:
        self._child(self.ttft, tier).observe(seconds)

    def observe_tpot(self, tier: str, seconds: float) -> None:
        self._child(self.tpot, tier).observe(seconds)

    def observe_inter_token(self, tier: str, seconds: float) -> None:
        self._child(self.inter_token, tier).observe(seconds)

    def count_request(self, tier: str, status: str) -> None:
        self._child(self.requests, tier, _member(status, REQUEST_STATUSES, "status")).inc()

    def count_rejection(self, tier: str, reason: str) -> None:
        self._child(self.rejections, tier, _member(reason, REJECTION_REASONS, "reason")).inc()

    def _child(self, metric: Any, tier: str, *labels: str) -> Any:
        """The labelled series of a request-path metric."""
        # From a dict: labels() takes a lock and validates on every call, a measurable share of a 429.
        key = (id(metric), tier, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self._tier(tier), *labels)
        return child

    def count_tokens(self, tier: str, kind: str, n: int) -> None:
        """Called by ``on_engine_event``; a caller that listens to the engine must not count tokens again."""
        if n < 0:
            raise ValueError(f"token count must be non-negative, got {n}")
        self.tokens.labels(self._tier(tier), _member(kind, TOKEN_KINDS, "kind")).inc(n)

    # -- the engine thread -------------------------------------------------

    def on_engine_event(self, event: EngineEvent) -> None:
        """Engine listener (engine thread)."""
        if isinstance(event, StepEvent):
            self._on_step(event)
        else:
            self._on_finish(event)

    def _on_step(self, event: StepEvent) -> None:
        self.step_seconds.observe(event.duration_s)
        if event.draft_tokens:
            self.spec_draft_tokens.inc(event.draft_tokens)
            self.spec_accepted_tokens.inc(event.accepted_tokens)
        for _, tier in event.preempted:
            if tier in self.tier_names:
                self.preemptions.labels(tier).inc()
        for item, seconds in event.seconds_by_item():
            tier = item.charged_tier
            if tier not in self.tier_names:
                continue
            self.gpu_seconds.labels(tier).inc(seconds)
            if item.is_recompute:
                self.tokens.labels(tier, "recompute").inc(item.tokens)

    def _on_finish(self, event: FinishEvent) -> None:
        if event.tier not in self.tier_names:
            return
        self.count_tokens(event.tier, "prompt", event.prompt_tokens)
        self.count_tokens(event.tier, "completion", event.completion_tokens)
        self.count_tokens(event.tier, "cached", event.cached_tokens)

    # -- scrape time -------------------------------------------------------

    def attach_engine(self, engine: EngineLike) -> None:
        """Read queue depth, KV usage, reserves and adapter counters from ``engine`` at every scrape."""
        for collector in (self._engine_collector, self._epp_collector):
            if collector is not None:
                self.registry.unregister(collector)
        self._engine_collector = _EngineStateCollector(engine, self.tiers)
        self.registry.register(self._engine_collector)
        self._epp_collector = EndpointPickerCollector(engine, lambda: self.draining, self.vllm_names)
        self.registry.register(self._epp_collector)

    def _tier(self, tier: str) -> str:
        return _member(tier, self.tier_names, "tier")


class _EngineStateCollector(Collector):
    """Gauges read from the engine when Prometheus scrapes, so they are never stale."""

    def __init__(self, engine: EngineLike, tiers: Iterable[TierConfig]) -> None:
        self.engine = engine
        self.tiers = tuple(tiers)

    def describe(self) -> list[Any]:
        # Names only, so registration checks for clashes without calling the engine.
        return list(self._families())

    def collect(self) -> Iterator[Any]:
        return iter(self._families(self.engine))

    def _families(self, engine: EngineLike | None = None) -> list[Any]:
        queue = GaugeMetricFamily("tiergate_queue_depth", "Requests waiting for their first step.", labels=["tier"])
        running = GaugeMetricFamily("tiergate_running_requests", "Requests in the running batch.", labels=["tier"])
        predicted = GaugeMetricFamily(
            "tiergate_predicted_ttft_seconds", "Admission control's TTFT estimate for a new request.", labels=["tier"]
        )
        used = GaugeMetricFamily("tiergate_kv_blocks_used", "KV blocks held by the tier's requests.", labels=["tier"])
        total = GaugeMetricFamily("tiergate_kv_blocks_total", "KV blocks in the pool.")
        reserved = GaugeMetricFamily(
            "tiergate_kv_blocks_reserved", "KV blocks only this tier (or better) may use.", labels=["tier"]
        )
        loads = CounterMetricFamily("tiergate_adapter_loads", "LoRA adapters read from disk.")
        hits = CounterMetricFamily(
            "tiergate_adapter_cache_hits", "A step's adapter found in a device slot or the host cache (no disk read)."
        )
        spread = GaugeMetricFamily(
            "tiergate_fair_share_counter_spread",
            "Max minus min virtual token counter over the tier's tenants with requests waiting (fair share).",
            labels=["tier"],
        )
        families = [queue, running, predicted, used, total, reserved, loads, hits, spread]
        if engine is None:
            return families
        for tier, load in engine.load().items():
            queue.add_metric([tier], load.queue_depth)
            running.add_metric([tier], load.running)
            predicted.add_metric([tier], load.predicted_ttft_s)
        used_by_tier, num_blocks = engine.kv_usage()
        for tier_config in self.tiers:
            used.add_metric([tier_config.name], used_by_tier.get(tier_config.name, 0))
            reserved.add_metric([tier_config.name], int(num_blocks * tier_config.kv_reserve_fraction))
        total.add_metric([], num_blocks)
        spreads = _fair_share_spread(engine)
        for tier_config in self.tiers:
            spread.add_metric([tier_config.name], spreads.get(tier_config.name, 0.0))
        adapter_loads, adapter_hits = _adapter_counts(engine)
        loads.add_metric([], adapter_loads)
        hits.add_metric([], adapter_hits)
        return families


def _adapter_counts(engine: Any) -> tuple[int, int]:
    # The engine's LoRA pool keeps the counters; an engine built without one
    # (max_loras=0) has loaded no adapter and served no hit.
    pool = getattr(engine, "lora_pool", None)
    if pool is None:
        return 0, 0
    return int(pool.loads), int(pool.cache_hits)


def _fair_share_spread(engine: Any) -> dict[str, float]:
    # Only an engine under the tiered policy with fair share keeps counters.
    spread = getattr(engine, "fair_share_spread", None)
    return spread() if spread is not None else {}


def _member(value: str, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
    return value


def render(metrics: GatewayMetrics) -> tuple[bytes, str]:
    """The /metrics body and its content type (Prometheus text format 0.0.4)."""
    # 0.0.4 names exactly what generate_latest writes; Prometheus 2.x (Debian
    # 12's) does not know the "version=1.0.0" that the client now calls latest.
    return generate_latest(metrics.registry), CONTENT_TYPE_PLAIN_0_0_4
