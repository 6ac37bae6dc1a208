"""Function calling: `tools` and `tool_choice` in, the prompt's tools and grammar, `tool_calls` out.

Calls are written in the Hermes form many open models are trained on, one
block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that takes ``tools`` renders them itself; otherwise the tools
and this form are described in a system message (``FALLBACK_PROMPT``). The
grammar makes ``required`` and named choices produce only calls, and lets
``auto`` answer in text until the model opens a ``<tool_call>``, from where the
call must be one of the tools with arguments valid for its schema.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import MAX_WHITESPACE_RUN, GrammarSpec, well_formed_strings
from gateway.errors import invalid_param

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_BEGIN = CALL_OPEN + '\n{"name": "'
_CALL_ARGUMENTS = '", "arguments": '
_CALL_END = "}\n" + CALL_CLOSE
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FALLBACK_PROMPT = (
    "You can call functions. Their names and JSON Schemas:\n{tools}\n"
    "To call one, reply with a block like this, one block per call:\n"
    + CALL_OPEN + '\n{{"name": "<function name>", "arguments": <arguments as a JSON object>}}\n' + CALL_CLOSE
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def openai(self) -> dict:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True

    def grammar(self) -> GrammarSpec | None:
        if self.choice == "none":
            return None
        tools = [t for t in self.tools if self.choice != "named" or t.name == self.named]
        tags = [{"type": "tag", "begin": _CALL_BEGIN + t.name + _CALL_ARGUMENTS, "end": _CALL_END,
                 "content": {"type": "json_schema", "json_schema": well_formed_strings(t.parameters),
                             "max_whitespace_cnt": MAX_WHITESPACE_RUN}} for t in tools]
        if self.choice == "named":
            fmt: dict = tags[0]
        elif self.choice == "required":
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                   "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
                   "stop_after_first": not self.parallel}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt},
                                                         ensure_ascii=False, sort_keys=True))


def _tool(i: int, raw: Any) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise invalid_param(param, f"Invalid value for '{param}': only tools of type 'function' with a "
                            "'function' object are supported.", "invalid_value")
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid_param(f"{param}.function.name", f"Invalid value for '{param}.function.name': it must be "
                            "1 to 64 letters, digits, underscores or dashes.", "invalid_value")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise invalid_param(f"{param}.function.parameters", f"Invalid type for '{param}.function.parameters': "
                            "expected a JSON Schema object.", "invalid_type")
    description = fn.get("description")
    return Tool(name, description if isinstance(description, str) else None, parameters)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    raw_tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_param("parallel_tool_calls", "Invalid type for 'parallel_tool_calls': expected a boolean.",
                            "invalid_type")
    if raw_tools is None:
        if choice not in (None, "none"):
            raise invalid_param("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.",
                                "invalid_value")
        return None
    if not isinstance(raw_tools, list) or not raw_tools:
        raise invalid_param("tools", "Invalid value for 'tools': expected a non-empty array.", "invalid_value")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw_tools))
    if len({t.name for t in tools}) != len(tools):
        raise invalid_param("tools", "Invalid value for 'tools': function names must be unique.", "invalid_value")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if named not in {t.name for t in tools}:
            raise invalid_param("tool_choice", "Invalid value for 'tool_choice': a named choice must be "
                                "{'type': 'function', 'function': {'name': ...}} naming one of 'tools'.",
                                "invalid_value")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise invalid_param("tool_choice", f"Invalid value for 'tool_choice': {choice!r}; expected 'none', "
                            "'auto', 'required' or a named function.", "invalid_value")
    return ToolRequest(tools, choice, named, parallel if parallel is not None else True)


# ---- the prompt ---------------------------------------------------------------


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_call(call: dict) -> str:
    """An assistant's earlier call, in the form this module parses."""
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except (TypeError, ValueError):
        arguments = fn["arguments"]
    return f"{CALL_OPEN}\n" + json.dumps({"name": fn["name"], "arguments": arguments}) + f"\n{CALL_CLOSE}"


def chat_messages(messages, tools: ToolRequest | None, takes_tools: bool) -> list[dict]:
    """The conversation as the chat template's dicts; without template support, tools and tool
    turns are written as text (a system message, call blocks, ``<tool_response>`` user turns)."""
    out: list[dict] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if takes_tools:
            if m.tool_calls:
                d["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(c)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            d["content"] = "\n".join([m.content] * bool(m.content) + [render_call(c) for c in m.tool_calls])
        elif m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        out.append(d)
    if tools is not None and not takes_tools:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.openai()["function"]) for t in tools.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_object(call: dict) -> Any:
    # Templates index into the arguments; clients send them as a JSON string.
    try:
        return json.loads(call["function"]["arguments"])
    except (TypeError, ValueError):
        return call["function"]["arguments"]


# ---- the answer ---------------------------------------------------------------


def _call_dict(block: str) -> dict | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}


@dataclass
class ToolCallParser:
    """Splits generated text into content and calls as it streams in.

    Text that could be the start of ``<tool_call>`` is held back until it is
    known either way; a call is given out whole, once its block closes.
    """

    calls: list[dict] = field(default_factory=list)
    _pending: str = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to show, calls completed) for ``text``, the next piece of the output."""
        self._pending += text
        content, calls = "", []
        while True:
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._pending, CALL_OPEN)
                content += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                break
            end = self._pending.find(CALL_CLOSE, start)
            if end < 0:
                content += self._pending[:start]
                self._pending = self._pending[start:]
                break
            call = _call_dict(self._pending[start + len(CALL_OPEN): end])
            if call is None:  # not a call after all: it stays text
                content += self._pending[: end + len(CALL_CLOSE)]
            else:
                content += self._pending[:start]
                calls.append(call)
            self._pending = self._pending[end + len(CALL_CLOSE):]
        if self.calls or calls:  # whitespace between calls is the grammar's separator, not an answer
            content = content if content.strip() else ""
        self.calls.extend(calls)
        return content, calls

    def finish(self) -> str:
        """Whatever is held back (an unfinished call, cut by max_tokens), as content."""
        rest, self._pending = self._pending, ""
        return rest if not (self.calls and not rest.strip()) else ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None, calls)."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    content += parser.finish()
    if parser.calls:
        content = content.strip()
    return (content if content or not parser.calls else None), parser.calls
