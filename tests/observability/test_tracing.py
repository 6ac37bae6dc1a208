"""Request traces: the span tree of one request, its GenAI attributes, and OTLP export only when configured."""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine.events import FinishEvent, StepEvent, StepItem
from engine.request import Usage
from gateway.tracing import Tracing


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter) -> Tracing:
    tracing = Tracing(exporter)
    yield tracing
    tracing.shutdown()


def start(tracing: Tracing, request_id: str = "chatcmpl-1", **overrides):
    fields = dict(request_id=request_id, operation="chat", model="smollm2", tenant="acme", tier="premium",
                  adapter="french", max_tokens=8, temperature=0.0, top_k=40, presence_penalty=0.5, seed=7, stream=True)
    return tracing.start_request(**{**fields, **overrides})


def spans_by_name(exporter: InMemorySpanExporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_streamed_request_has_queue_prefill_and_decode_under_its_span(tracing, exporter):
    trace = start(tracing)
    trace.mark_submitted()
    time.sleep(0.002)
    tracing.on_engine_event(StepEvent(0.01, (StepItem("chatcmpl-1", 5, False),), started_at=time.time()))
    time.sleep(0.002)
    trace.mark_first_token()
    tracing.on_engine_event(StepEvent(0.01, (StepItem("chatcmpl-1", 1, False),), started_at=time.time()))
    time.sleep(0.002)
    trace.finish(Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2), finish_reason="stop")

    spans = spans_by_name(exporter)
    assert set(spans) == {"chat smollm2", "queue", "prefill", "decode"}
    root = spans["chat smollm2"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time == root.end_time
    assert [e.name for e in root.events] == ["first_token"]
    assert root.events[0].timestamp == decode.start_time
    assert dict(root.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "tiergate",
        "gen_ai.request.model": "smollm2",
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.presence_penalty": 0.5,
        "gen_ai.request.seed": 7,
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.model": "smollm2",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 2,
        "tiergate.request_id": "chatcmpl-1",
        "tiergate.tenant": "acme",
        "tiergate.tier": "premium",
        "tiergate.adapter": "french",
    }
    assert root.status.status_code == StatusCode.UNSET


def test_only_the_first_step_of_a_request_ends_its_queue_wait(tracing, exporter):
    trace = start(tracing)
    trace.mark_submitted()
    time.sleep(0.001)
    first_step = time.time()
    tracing.on_engine_event(StepEvent(0.01, (StepItem("other", 4, False), StepItem("chatcmpl-1", 4, False)),
                                      started_at=first_step))
    time.sleep(0.001)
    tracing.on_engine_event(StepEvent(0.01, (StepItem("chatcmpl-1", 4, False),), started_at=time.time()))
    tracing.on_engine_event(FinishEvent("other", 4, 1, "ok"))  # finish events carry nothing for traces
    trace.mark_first_token()
    trace.finish(Usage(8, 1), finish_reason="length")
    assert spans_by_name(exporter)["queue"].end_time == int(first_step * 1e9)


def test_an_engine_error_marks_the_request_span_failed(tracing, exporter):
    trace = start(tracing)
    trace.mark_submitted()
    tracing.on_engine_event(StepEvent(0.01, (StepItem("chatcmpl-1", 5, False),), started_at=time.time()))
    trace.finish(Usage(5, 0), finish_reason="error", error="CUDA out of memory")
    spans = spans_by_name(exporter)
    assert spans["chat smollm2"].status.status_code == StatusCode.ERROR
    assert spans["chat smollm2"].status.description == "CUDA out of memory"
    assert set(spans) == {"chat smollm2", "queue", "prefill"}  # no token came: no decode


def test_a_request_refused_before_the_engine_is_one_span(tracing, exporter):
    trace = start(tracing)
    trace.finish(error="rate limit")
    trace.finish(error="twice")  # a second finish changes nothing
    [span] = exporter.get_finished_spans()
    assert span.name == "chat smollm2" and span.status.description == "rate limit"


def test_a_caller_traceparent_continues_its_trace(tracing, exporter):
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"}
    trace = start(tracing, headers=headers)
    assert trace.trace_id == caller_trace
    trace.finish(Usage(1, 1), "stop")
    [span] = exporter.get_finished_spans()
    assert span.parent.span_id == 0x00F067AA0BA902B7


def test_traces_of_finished_requests_are_not_kept(tracing):
    trace = start(tracing)
    trace.mark_submitted()
    trace.finish(error="client went away")  # before any engine step
    assert tracing._waiting == {}


class _OtlpReceiver(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]]

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.received.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_spans_go_over_otlp_http_when_the_endpoint_is_set(monkeypatch):
    with otlp_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.server_port}")
        tracing = Tracing()
        trace = start(tracing)
        trace.mark_submitted()
        trace.mark_first_token()
        trace.finish(Usage(3, 2), "stop")
        tracing.shutdown()  # flushes the batch
        assert [path for path, _ in receiver.received] == ["/v1/traces"]
        request = ExportTraceServiceRequest.FromString(receiver.received[0][1])
        names = {s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
        assert names == {"chat smollm2", "queue", "decode"}
        resource = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
        assert resource["service.name"] == "tiergate"


def test_nothing_is_exported_without_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    exported = []
    monkeypatch.setattr(OTLPSpanExporter, "export", lambda self, spans: exported.extend(spans))
    tracing = Tracing()
    trace = start(tracing)
    trace.mark_submitted()
    trace.finish(Usage(3, 0), "stop")
    tracing.shutdown()
    assert tracing.exporting is False
    assert exported == []
    assert len(trace.trace_id) == 32 and trace.trace_id != "0" * 32  # ids still reach the logs


def test_a_request_the_engine_ends_before_any_step_is_forgotten_at_its_finish_event(tracing, exporter):
    trace = start(tracing)
    trace.mark_submitted()
    tracing.on_engine_event(FinishEvent("chatcmpl-1", 4, 0, "error"))  # refused by the engine
    tracing.on_engine_event(StepEvent(0.01, (StepItem("chatcmpl-1", 4, False),), started_at=time.time()))
    trace.finish(error="refused")
    assert set(spans_by_name(exporter)) == {"chat smollm2", "queue"}  # the later step is not its prefill
