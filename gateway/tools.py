"""Function calling: `tools` and `tool_choice` in, the prompt's tools and the call grammar.

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
from dataclasses import dataclass
from typing import Any

from engine.grammar import MAX_WHITESPACE_RUN, GrammarSpec, check_schema_depth
from gateway.errors import invalid_param

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# A call is written CALL_OPEN + CALL_NAMED + name + CALL_ARGUMENTS + arguments + CALL_END.
CALL_NAMED = '\n{"name": "'
CALL_ARGUMENTS = '", "arguments": '
CALL_END = "}\n" + CALL_CLOSE
CALL_NAME = "[A-Za-z0-9_-]{1,64}"
_NAME = re.compile(f"^{CALL_NAME}$")
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
        for t in tools:  # before json.dumps below walks them recursively
            check_schema_depth(t.parameters)
        tags = [{"type": "tag", "begin": CALL_OPEN + CALL_NAMED + t.name + CALL_ARGUMENTS, "end": CALL_END,
                 "content": {"type": "json_schema", "json_schema": t.parameters,
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
