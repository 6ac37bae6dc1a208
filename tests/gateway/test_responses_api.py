"""OpenAI's Responses API through the official `openai` client against a live server (a random tiny model)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from sqlalchemy import select

from billing.models import UsageEntry
from tests.gateway.test_openai_client import client_for
from tests.gateway.test_structured_outputs import live, long_context_model_dir  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def ledger_rows(db, request_id: str) -> list[tuple]:
    with db.connect() as c:
        return c.execute(select(UsageEntry.status, UsageEntry.prompt_tokens, UsageEntry.completion_tokens)
                         .where(UsageEntry.request_id == request_id)).all()


ADD = {"type": "function", "name": "add", "description": "adds",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["a"], "additionalProperties": False}}


def test_a_text_response_has_the_chat_answer_usage_and_one_ledger_row(server):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, max_output_tokens=8, temperature=0)
    out = client.responses.create(input="hello there", instructions="be brief", **kwargs)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hello there"}],
                                          model=server.engine.model_name, max_tokens=8, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                chat.usage.completion_tokens)
    assert out.instructions == "be brief" and out.max_output_tokens == 8
    assert ledger_rows(server.db, out.id) == [("ok", out.usage.input_tokens, out.usage.output_tokens)]


def test_message_items_and_function_call_history_are_the_chat_messages_they_stand_for(live):
    server, client = live, client_for(live)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "add 1"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "1"}]
    out = client.responses.create(model=server.engine.model_name, input=items, tools=[ADD], tool_choice="none",
                                  max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(
        model=server.engine.model_name, max_tokens=4, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: ADD[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "add 1"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "1"}])
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_come_in_order_and_add_up_to_the_whole_response(server):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, input="stream me", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.output[0].content[0].text == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_choice_answers_with_a_function_call_valid_for_its_schema(live, stream):
    server, client = live, client_for(live)
    kwargs = dict(model=server.engine.model_name, input="add something", tools=[ADD], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=256, temperature=0)
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            out = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    else:
        out = client.responses.create(**kwargs)
    [call] = [item for item in out.output if item.type == "function_call"]
    assert out.status == "completed"
    assert call.name == "add" and call.call_id.startswith("call_") and call.status == "completed"
    assert 0 <= json.loads(call.arguments)["a"] <= 9


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_makes_a_random_model_answer_json_valid_for_the_schema(server, stream):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, input="answer", max_output_tokens=200, temperature=1.0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
    if stream:  # the SDK's stream helper checks the events' order and items as it accumulates them
        with client.responses.stream(**kwargs) as events:
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            out = events.get_final_response()
        assert "".join(deltas) == out.output_text
    else:
        out = client.responses.create(**kwargs)
    assert out.status == "completed"
    assert isinstance(json.loads(out.output_text)["ok"], bool)
    assert out.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "fooo"}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x" * 400}, "input"),
    ({"max_output_tokens": 300}, "max_output_tokens"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
])
def test_what_is_not_served_is_a_400_naming_the_parameter(server, extra, param):
    client = client_for(server)
    body = {"model": server.engine.model_name, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{k: v for k, v in body.items() if k not in ("frequency_penalty",)},
                                extra_body={"frequency_penalty": 1} if "frequency_penalty" in extra else None)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_responses_need_a_key_and_count_against_the_tenants_rpm(serve):
    live = serve()
    live.add_tenant("tiny", "standard", rpm=1, tpm=100_000, max_concurrent=4)
    body = {"model": live.engine.model_name, "input": "hi", "max_output_tokens": 2}
    assert httpx.post(f"{live.url}/v1/responses", json=body).status_code == 401
    headers = {"authorization": f"Bearer {live.keys['tiny']}"}
    assert httpx.post(f"{live.url}/v1/responses", json=body, headers=headers, timeout=60).status_code == 200
    refused = httpx.post(f"{live.url}/v1/responses", json=body, headers=headers, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
