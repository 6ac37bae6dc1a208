"""response_format and tools through the real `openai` client, on a tiny RANDOM model.

The model's weights are random and its tokenizer is 256 bytes, so any JSON or
tool call it returns is there only because the grammar allowed nothing else.
Its chat template does not take tools: they reach it through the fallback
system prompt, which needs a longer context than the shared tiny model has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from engine.config import EngineConfig
from engine.engine import Engine
from tests.tiny_llama import CHAT_TEMPLATE, write_byte_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_llama(tmp_path_factory.mktemp("tiny-llama-2k"), max_position_embeddings=2048,
                            chat_template=CHAT_TEMPLATE)


@pytest.fixture
def live(serve, long_context_model_dir: Path):
    engine = Engine(EngineConfig(model=f"dummy:{long_context_model_dir}", num_kv_blocks=256, block_size=16,
                                 max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=1024, max_loras=0))
    server = serve(engine=engine)
    server.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    return server


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=live.keys["acme"], max_retries=0)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _chat(live, client, **kwargs):
    kwargs = {"model": live.engine.model_name, "messages": [{"role": "user", "content": "go"}],
              "max_tokens": 300, **kwargs}
    return client.chat.completions.create(**kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parse_with_a_pydantic_model_gives_a_valid_instance(live, client, seed):
    out = client.chat.completions.parse(model=live.engine.model_name, messages=[{"role": "user", "content": "a pet"}],
                                        response_format=Pet, max_tokens=300, seed=seed, temperature=1.0)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and out.choices[0].finish_reason == "stop"


def test_json_object_mode_answers_a_json_object(live, client):
    for seed in range(3):
        out = _chat(live, client, response_format={"type": "json_object"}, seed=seed, max_tokens=60)
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # a random model's object can outrun max_tokens; what it wrote is still an object's start
            assert choice.finish_reason == "length" and choice.message.content.lstrip().startswith("{")


def test_text_response_format_is_plain_generation(live, client):
    free = _chat(live, client, temperature=0, max_tokens=8)
    text = _chat(live, client, temperature=0, max_tokens=8, response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fooo"}}}, "Unsupported type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5,
                                                                          "maxLength": 3}}}, "greater than maxLength"),
    ],
)
def test_a_bad_response_format_is_a_400_saying_why(live, client, response_format, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        _chat(live, client, response_format=response_format)
    assert info.value.body["param"].startswith("response_format")
    assert live.engine.scheduler.num_used_blocks == 0


def test_required_tool_choice_returns_valid_calls(live, client):
    # With parallel calls allowed, a model without a stop token goes on calling until max_tokens;
    # the calls it closed are returned whole, and the one max_tokens cut (as OpenAI does) with what it wrote.
    for seed in range(2):
        out = _chat(live, client, tools=[WEATHER, ADD], tool_choice="required", seed=seed, temperature=1.0)
        choice = out.choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason in ("tool_calls", "length") and len(calls) >= 2
        if choice.finish_reason == "length" and not _parses(calls[-1].function.arguments):
            assert calls[-1].function.arguments.startswith("{")
            calls = calls[:-1]
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.id.startswith("call_") and call.function.name in ("get_weather", "add")
            assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"a", "b"})


def test_parallel_tool_calls_false_gives_one_call(live, client):
    out = _chat(live, client, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, seed=5,
                temperature=1.0)
    assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls) == 1


def test_a_streamed_call_comes_whole_in_one_chunk_the_client_reads_as_the_final_call(live, client):
    named = {"type": "function", "function": {"name": "add"}}
    with client.beta.chat.completions.stream(model=live.engine.model_name, messages=[{"role": "user", "content": "1+2"}],
                                             tools=[WEATHER, ADD], tool_choice=named, max_tokens=300,
                                             seed=3, temperature=1.0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    chunks = [e.chunk.choices[0].delta.tool_calls for e in events if e.type == "chunk" and e.chunk.choices
              and e.chunk.choices[0].delta.tool_calls]
    [[whole]] = chunks
    assert whole.id.startswith("call_") and whole.type == "function" and whole.function.name == "add"
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == ["add"]
    assert whole.function.arguments == choice.message.tool_calls[0].function.arguments
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(args) == {"a", "b"} and 0 <= args["a"] <= 99 and 0 <= args["b"] <= 99


def test_a_call_cut_by_max_tokens_comes_back_as_content_streamed_or_not(live, client):
    named = {"type": "function", "function": {"name": "add"}}
    # The byte tokenizer writes one character a token: the header is 41, so 48 end inside the arguments.
    kwargs = dict(tools=[WEATHER, ADD], tool_choice=named, max_tokens=48, seed=3, temperature=1.0)
    choice = _chat(live, client, **kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "add", "arguments": ')
    stream = client.chat.completions.create(model=live.engine.model_name, stream=True,
                                            messages=[{"role": "user", "content": "go"}], **kwargs)
    deltas = [c.choices[0] for c in stream if c.choices]
    assert not any(d.delta.tool_calls for d in deltas) and deltas[-1].finish_reason == "length"
    assert "".join(d.delta.content or "" for d in deltas) == choice.message.content


@pytest.mark.parametrize("parallel", [False, True])
def test_a_named_tool_choice_makes_one_call_to_that_function(live, client, parallel):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(live, client, tools=[WEATHER, ADD], tool_choice=named, parallel_tool_calls=parallel, seed=7,
                temperature=1.0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("c", "f") and len(args["city"]) <= 8


def test_auto_tool_choice_lets_the_model_answer_in_text(live, client):
    # A random model never happens to open a call, so auto leaves its text alone; the call grammar
    # behind the trigger is the same one `required` uses.
    out = _chat(live, client, tools=[WEATHER], tool_choice="auto", max_tokens=20, temperature=0)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content == _chat(live, client, tools=[WEATHER], tool_choice="none", max_tokens=20,
                                           temperature=0).choices[0].message.content


def test_a_tool_conversation_history_is_accepted(live, client):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    out = _chat(live, client, messages=messages, tools=[WEATHER], max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        _chat(live, client, messages=messages[:2] + [{"role": "tool", "content": "4 degrees"}], tools=[WEATHER])


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}}}], tool_choice="required"),
         "tools"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_parameter(live, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(live, client, **kwargs)
    assert info.value.body["param"] == param
