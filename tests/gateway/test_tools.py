"""gateway/tools.py without a server: the call grammar, the streaming parser, and the prompt's tools."""

from __future__ import annotations

import json

import pytest

from engine.grammar import GrammarCompiler
from engine.loader import byte_tokenizer
from gateway.schemas import Message
from gateway.tools import Tool, ToolCallParser, ToolRequest, chat_messages, split_tool_calls

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


def test_the_streaming_parser_holds_back_a_possible_call_and_gives_calls_whole():
    parser = ToolCallParser()
    pieces = ["Sure<tool", "_call>\n{\"name\": \"add\", ", '"arguments": {"a": 1}}\n</tool_', "call>"]
    out = [parser.feed(p) for p in pieces]
    assert [c for c, _ in out] == ["Sure", "", "", ""]
    assert [len(calls) for _, calls in out] == [0, 0, 0, 1]
    assert json.loads(out[-1][1][0]["function"]["arguments"]) == {"a": 1}
    assert parser.finish() == ""


def test_a_block_that_is_not_a_call_stays_text_and_a_cut_call_is_returned_as_text():
    content, calls = split_tool_calls("<tool_call>not json</tool_call>")
    assert content == "<tool_call>not json</tool_call>" and calls == []
    content, calls = split_tool_calls(CALL + '\n<tool_call>\n{"name": "ad')
    assert len(calls) == 1 and content.startswith("<tool_call>")


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
