"""gateway/tools.py and gateway/tool_calls.py without a server: the call grammar, the prompt's tools,
and the parser that streams calls out of the answer."""

from __future__ import annotations

import json

import pytest

from engine.grammar_compiler import GrammarCompiler
from engine.loader import byte_tokenizer
from gateway.schemas import Message
from gateway.tool_calls import ToolCallParser, split_tool_calls
from gateway.tools import Tool, ToolRequest, chat_messages

ADD = Tool("add", "adds", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                           "additionalProperties": False})
ECHO = Tool("echo", None, {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer(), 256, ())


def _accepts(compiler: GrammarCompiler, request: ToolRequest, text: str) -> bool:
    tokenizer = byte_tokenizer()
    matcher = compiler.matcher(request.grammar())
    return all(matcher.accept(t) for t in tokenizer.encode(text).ids)


def test_auto_leaves_text_free_until_a_call_opens_then_holds_the_call_to_a_tool(compiler):
    auto = ToolRequest((ADD, ECHO), "auto")
    assert _accepts(compiler, auto, "any text at all, then " + CALL)
    assert not _accepts(compiler, auto, 'hi <tool_call>\n{"name": "nope"')
    assert not _accepts(compiler, auto, 'hi <tool_call>\n{"name": "add", "arguments": {"b"')


def test_required_and_named_choices_allow_only_calls(compiler):
    assert _accepts(compiler, ToolRequest((ADD, ECHO), "required"), CALL)
    assert not _accepts(compiler, ToolRequest((ADD, ECHO), "required"), "hello")
    assert not _accepts(compiler, ToolRequest((ADD, ECHO), "named", "echo"), CALL)


def _stream(pieces: list[str]) -> list:
    parser = ToolCallParser()
    out = [parser.feed(p) for p in pieces]
    return out + [parser.finish()]


def test_the_streaming_parser_holds_a_call_until_it_closes_then_gives_it_whole():
    out = _stream(["Sure<tool", "_call>\n{\"name\": \"add\", ", '"arguments": {"a"', ": 1", "}}\n</tool_", "call>"])
    assert out[0] == ["Sure"] and out[1:4] == [[], [], []]
    [call] = out[4]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["index"] == 0
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert out[5:] == [[], []]


def test_calls_and_the_text_around_them_come_in_the_order_written():
    text = "Hi " + CALL + "\n" + CALL.replace("add", "echo").replace('"a": 1', '"s": "}{\\"]"') + " bye"
    pieces = _stream([text])[0]
    assert pieces[0] == "Hi " and pieces[-1] == " bye"
    calls = [p for p in pieces if isinstance(p, dict)]
    assert [c["index"] for c in calls] == [0, 1]
    assert json.loads(calls[1]["function"]["arguments"]) == {"s": '}{"]'}


def test_a_block_that_is_not_a_call_stays_text_and_a_cut_call_is_content():
    content, calls = split_tool_calls("<tool_call>not json</tool_call>")
    assert content == "<tool_call>not json</tool_call>" and calls == []
    content, calls = split_tool_calls(CALL + '\n<tool_call>\n{"name": "ad')
    assert len(calls) == 1 and content == '<tool_call>\n{"name": "ad'
    # Cut inside its arguments (finish_reason "length"): never a call whose arguments are not JSON.
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 4'
    content, calls = split_tool_calls(CALL + "\n" + cut)
    assert content == cut and [c["function"]["arguments"] for c in calls] == ['{"a": 1}']
    streamed = _stream([CALL + "\n", cut[:20], cut[20:]])
    assert [p for piece in streamed for p in piece if isinstance(p, str)] == [cut]


def test_without_template_support_tools_and_tool_turns_become_text():
    messages = [Message("user", "sum"), Message("assistant", "", tool_calls=(
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},)),
        Message("tool", "1", tool_call_id="c1")]
    out = chat_messages(messages, ToolRequest((ADD,), "auto"), takes_tools=False)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == CALL and out[3] == {"role": "user", "content": "<tool_response>\n1\n</tool_response>"}
    native = chat_messages(messages, ToolRequest((ADD,), "auto"), takes_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and native[2]["tool_call_id"] == "c1"


def test_a_template_that_takes_tools_renders_them_itself():
    from engine.tokenizer import TextTokenizer
    from gateway.tools import template_takes_tools

    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tokenizer = TextTokenizer(byte_tokenizer(), chat_template=template)
    assert template_takes_tools(template)
    messages = chat_messages([Message("user", "sum")], ToolRequest((ADD,), "auto"), takes_tools=True)
    assert tokenizer.render_chat(messages, [ADD.openai()]) == "[tool add]<user>sum<assistant>"
