"""SSE framing and OpenAI object shapes, from deltas alone."""

from __future__ import annotations

import json

from engine.request import TokenLogprob, Usage
from gateway import openai_format as fmt


def events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    return [e.decode() for e in raw.split(b"\n\n") if e]


def test_sse_event_is_one_data_line_even_with_newlines_in_text():
    raw = fmt.sse({"text": "a\nb\n\nc"})
    [event] = events(raw)
    assert event.startswith("data: ") and "\n" not in event
    assert json.loads(event[6:]) == {"text": "a\nb\n\nc"}


def test_sse_event_stays_one_line_for_clients_that_split_on_unicode_line_breaks():
    text = "a\u2028b\x85c\u2029d\re"
    event = fmt.sse({"text": text}).decode()
    line = event.removesuffix("\n\n")
    assert line.splitlines() == [line]  # Python's splitlines, as httpx's iter_lines
    assert json.loads(event.removeprefix("data: "))["text"] == text


def test_chat_stream_opens_with_role_and_closes_with_usage_chunk():
    w = fmt.ChunkWriter("chat", "chatcmpl-1", 123, "m", include_usage=True)
    first = json.loads(events(w.first())[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    last = json.loads(events(w.delta("", (), False, "length"))[0][6:])
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    usage = json.loads(events(w.usage(Usage(3, 2, 1)))[0][6:])
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}


def test_no_usage_chunk_unless_asked():
    w = fmt.ChunkWriter("completion", "cmpl-1", 1, "m", include_usage=False)
    assert w.first() == b"" and w.usage(Usage(1, 1)) == b""
    chunk = json.loads(events(w.delta("hi", (), False))[0][6:])
    assert "usage" not in chunk and chunk["choices"][0]["text"] == "hi"


def test_engine_only_finish_reasons_map_to_stop():
    assert fmt.finish_reason("abort") == "stop" and fmt.finish_reason("length") == "length"


def test_completion_logprobs_carry_text_offsets_across_chunks():
    w = fmt.ChunkWriter("completion", "cmpl-1", 1, "m", include_usage=False)
    lp = lambda t: TokenLogprob(1, t, -0.5, ((1, t, -0.5), (2, "z", -1.0)))  # noqa: E731
    w.delta("ab", (lp("a"), lp("b")), True)
    second = json.loads(events(w.delta("cd", (lp("cd"),), True))[0][6:])
    logprobs = second["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [2]
    assert logprobs["top_logprobs"] == [{"cd": -0.5, "z": -1.0}]


def test_chat_logprobs_shape():
    out = fmt.chat_logprobs([TokenLogprob(5, "é", -0.1, ((5, "é", -0.1),))])
    assert out["content"][0]["bytes"] == list("é".encode())
    assert out["content"][0]["top_logprobs"][0]["token"] == "é"
