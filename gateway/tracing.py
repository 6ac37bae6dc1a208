"""OpenTelemetry traces: one span per request, with child spans for queue wait, prefill and decode.

Each app owns a ``Tracing`` with its own TracerProvider (none is set globally).
Spans go to OTLP/HTTP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the
traces-specific variable) is set; otherwise no span is made at all: a request
still gets a trace id for its log lines (the caller's, from ``traceparent``, or
a new one) and nothing leaves the process.

The gateway's part, per request::

    trace = tracing.start_request(request_id=..., operation="chat", model=..., tenant=..., tier=...)
    trace.mark_submitted()           # right before engine.submit(...)
    ...  trace.mark_first_token()    # at the first delta with text or tokens
    trace.finish(usage=delta.usage, finish_reason=delta.finish_reason)   # or finish(error="...")

and ``engine.add_listener(tracing.on_engine_event)``: the first engine step that
computes a request's tokens ends its queue wait and starts its prefill. The
child spans are written at ``finish`` with the recorded timestamps.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.events import EngineEvent, StepEvent
from engine.request import Usage

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """The tracer of one app. ``exporter`` (tests) is used as given, synchronously; otherwise OTLP if configured."""

    def __init__(self, exporter: SpanExporter | None = None, *, service_name: str = "tiergate") -> None:
        configured = any(os.environ.get(name) for name in _ENDPOINT_VARS)
        self.exporting = exporter is not None or configured
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif configured:
            # Imported here: the exporter pulls in requests and protobuf, which a
            # gateway without a collector never needs.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # It reads the endpoint, headers and timeout from the standard OTEL_* variables.
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("tiergate.gateway")
        self._waiting: dict[str, RequestTrace] = {}  # submitted, not yet seen in an engine step
        self._lock = threading.Lock()
        self._ids = random.Random()  # trace ids when not exporting, as the SDK draws them

    def start_request(
        self,
        *,
        request_id: str,
        operation: str,
        model: str,
        tenant: str,
        tier: str,
        adapter: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stream: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> RequestTrace:
        """Open the request's span; ``headers`` may carry a W3C ``traceparent`` to continue a caller's trace."""
        parent = _PROPAGATOR.extract(headers) if headers and "traceparent" in headers else None
        if not self.exporting:
            # Nothing is recorded: the request needs only a trace id for its log lines, the caller's
            # or a new one; drawing it here costs a tenth of even an unsampled SDK span (~40 us).
            trace_id = otel_trace.get_current_span(parent).get_span_context().trace_id if parent else 0
            return RequestTrace(self, request_id, model, None, trace_id or self._ids.getrandbits(128))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "tiergate",
            "gen_ai.request.model": model,
            "gen_ai.request.stream": stream,
            "tiergate.request_id": request_id,
            "tiergate.tenant": tenant,
            "tiergate.tier": tier,
        }
        optional = {
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature,
            "gen_ai.request.top_p": top_p,
            "gen_ai.request.top_k": top_k,
            "gen_ai.request.presence_penalty": presence_penalty,
            "gen_ai.request.frequency_penalty": frequency_penalty,
            "gen_ai.request.seed": seed,
            "tiergate.adapter": adapter,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        span = self.tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return RequestTrace(self, request_id, model, span, span.get_span_context().trace_id)

    def on_engine_event(self, event: EngineEvent) -> None:
        """Engine listener (engine thread): the first step computing a request's tokens starts its prefill."""
        if not self.exporting:
            return
        if not isinstance(event, StepEvent):  # the request ended without a step (refused by the engine)
            self._forget(event.request_id)
            return
        started_ns = int(event.started_at * 1e9) if event.started_at else time.time_ns()
        with self._lock:
            for item in event.items:
                waiting = self._waiting.pop(item.request_id, None)
                if waiting is not None:
                    waiting.scheduled_ns = started_ns

    def shutdown(self) -> None:
        """Flush and stop exporting (the app's shutdown)."""
        self.provider.shutdown()

    def _wait_for_step(self, request: RequestTrace) -> None:
        with self._lock:
            self._waiting[request.request_id] = request

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)


class RequestTrace:
    """The span of one request and the moments that split it into queue, prefill and decode."""

    def __init__(self, tracing: Tracing, request_id: str, model: str, span: otel_trace.Span | None,
                 trace_id: int) -> None:
        self._tracing = tracing
        self.request_id = request_id
        self.model = model
        self.span = span  # None when nothing is exported
        self._trace_id = trace_id
        self.submitted_ns: int | None = None
        self.scheduled_ns: int | None = None  # set from the engine thread
        self.first_token_ns: int | None = None
        self.finished = False

    @property
    def trace_id(self) -> str:
        """Hex trace id, for log lines."""
        return format(self._trace_id, "032x")

    def mark_submitted(self) -> None:
        """The request goes to the engine now: its queue wait starts."""
        self.submitted_ns = time.time_ns()
        if self._tracing.exporting:
            self._tracing._wait_for_step(self)

    def mark_first_token(self) -> None:
        if self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
            if self.span is not None:
                self.span.add_event("first_token", timestamp=self.first_token_ns)

    def finish(self, usage: Usage | None = None, finish_reason: str | None = None, error: str | None = None) -> None:
        """Write the child spans and end the request's span; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        if self.span is None:
            return
        end_ns = time.time_ns()
        self._tracing._forget(self.request_id)
        self._write_phases(end_ns)
        self.span.set_attribute("gen_ai.response.id", self.request_id)
        self.span.set_attribute("gen_ai.response.model", self.model)
        if usage is not None:
            self.span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            self.span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            self.span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cached_tokens)
        if finish_reason is not None:
            self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=end_ns)

    def _write_phases(self, end_ns: int) -> None:
        if self.submitted_ns is None:
            return  # refused before reaching the engine: the request span alone tells it
        first_token_ns = self.first_token_ns
        scheduled_ns = self.scheduled_ns
        # Clamp: the step's start comes from another clock read on another thread.
        if scheduled_ns is not None:
            scheduled_ns = min(max(scheduled_ns, self.submitted_ns), first_token_ns or end_ns)
        queue_end = scheduled_ns or first_token_ns or end_ns
        self._child("queue", self.submitted_ns, queue_end)
        if scheduled_ns is not None:
            self._child("prefill", scheduled_ns, first_token_ns or end_ns)
        if first_token_ns is not None:
            self._child("decode", first_token_ns, end_ns)

    def _child(self, name: str, start_ns: int, end_ns: int) -> None:
        context = otel_trace.set_span_in_context(self.span)
        child = self._tracing.tracer.start_span(name, context=context, start_time=start_ns)
        child.end(end_time=max(start_ns, end_ns))
