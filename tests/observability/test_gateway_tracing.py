"""The span tree of one streamed request through the real gateway route, read from OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import pytest

from tests.observability.live_gateway import stream_chat

pytestmark = pytest.mark.slow

CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def test_a_streamed_chat_request_is_one_span_with_queue_prefill_and_decode(gateway, span_exporter):
    span_exporter.clear()
    with gateway.client("acme") as client:
        client.headers["traceparent"] = f"00-{CALLER_TRACE_ID}-b7ad6b7169203331-01"
        usage = stream_chat(client, gateway.model, "trace me", max_tokens=5)

    spans = [s for s in span_exporter.get_finished_spans() if format(s.context.trace_id, "032x") == CALLER_TRACE_ID]
    by_name = {s.name: s for s in spans}
    root = by_name[f"chat {gateway.model}"]
    assert sorted(by_name) == sorted([root.name, "queue", "prefill", "decode"])
    assert root.parent.span_id == 0xB7AD6B7169203331  # continues the caller's trace
    for name in ("queue", "prefill", "decode"):
        assert by_name[name].parent.span_id == root.context.span_id
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time <= root.end_time

    attributes = dict(root.attributes)
    request_id = attributes["gen_ai.response.id"]
    assert request_id.startswith("chatcmpl-")
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == gateway.model
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["tiergate.tenant"] == "acme"
    assert attributes["tiergate.tier"] == "premium"
    assert attributes["tiergate.request_id"] == request_id
