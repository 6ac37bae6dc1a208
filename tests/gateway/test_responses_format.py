"""gateway/responses_format.py without a server: chat answers and chunks reframed as Responses API objects."""

from __future__ import annotations

import json

from gateway.responses_format import ResponseEvents, ResponseShape, from_chat

SHAPE = ResponseShape(model="m")
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}


def _events(chunks: list[dict]) -> list[dict]:
    events = ResponseEvents(SHAPE, "resp_1", 100)
    data = b"".join(events.feed(c) for c in chunks) + events.done()
    frames = [frame.split(b"\n") for frame in data.split(b"\n\n") if frame]
    assert all(kind == b"event: " + json.loads(payload[6:])["type"].encode() for kind, payload in frames)
    return [json.loads(payload[6:]) for _, payload in frames]


def _chunk(delta: dict, reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}], "usage": None}


def test_text_then_a_call_stream_as_two_items_each_opened_and_closed_in_order():
    events = _events([
        _chunk({"role": "assistant", "content": ""}), _chunk({"content": "Sure"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_ab", "type": "function",
                                "function": {"name": "add", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
        _chunk({}, "tool_calls"), {"choices": [], "usage": USAGE},
    ])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1] | {"id": None} == {"type": "function_call", "id": None, "call_id": "call_ab",
                                                  "name": "add", "arguments": '{"a": 1}', "status": "completed"}
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 2} and final["usage"]["total_tokens"] == 10


def test_a_cut_answer_is_incomplete_for_max_output_tokens_and_an_engine_error_fails_the_response():
    cut = _events([_chunk({"content": "abc"}, "length"), {"choices": [], "usage": USAGE}])
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut[-2]["item"]["status"] == "incomplete"
    failed = _events([_chunk({"content": "a"}), {"error": {"message": "boom", "code": "engine_error"}}])
    assert failed[-1]["type"] == "response.failed"
    assert failed[-1]["response"]["error"] == {"code": "engine_error", "message": "boom"}
    assert failed[-2]["type"] == "response.output_item.done"


def test_a_whole_chat_answer_becomes_the_same_items():
    chat = {"id": "resp_2", "created": 5, "usage": USAGE, "choices": [{"index": 0, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    out = from_chat(SHAPE, chat)
    assert (out["id"], out["status"], out["created_at"]) == ("resp_2", "completed", 5)
    assert [(i["type"], i["call_id"], i["name"]) for i in out["output"]] == [("function_call", "call_x", "f")]
    assert out["usage"]["output_tokens"] == 3 and out["store"] is False
