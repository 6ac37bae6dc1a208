"""POST /v1/responses: OpenAI's Responses API, stateless, as a chat request on the one admission path.

The body is read into the chat request it means (``instructions`` and ``input`` items as messages,
function tools and ``tool_choice`` in their chat form, ``text.format`` as ``response_format``,
``max_output_tokens`` as ``max_completion_tokens``) and checked by the chat parser, whose errors
are renamed to the Responses API's parameters. It then runs through gateway/completions.py's
``generate`` like any chat request (limits, admission, fair share, one ledger row, metrics), and
gateway/responses_format.py reframes its answer. Nothing is stored: ``store: true``,
``previous_response_id``, ``conversation`` and the other stateful or unserved options are a 400
naming them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import responses_format as rf
from gateway.completions import Endpoint, generate
from gateway.errors import APIError, invalid_param
from gateway.generation import Generation
from gateway.json_fields import int_field, optional
from gateway.schemas import GenerationRequest, parse_chat

_PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "stream", "user"}  # same name and meaning in chat
_READ = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "stream_options"}
_NO_EFFECT = {"metadata", "service_tier", "safety_identifier", "prompt_cache_key"}
# Known arguments we do not serve: accepted only as null or as their no-op value.
_UNSERVED_NO_OP = {
    "store": lambda v: v is False,
    "previous_response_id": lambda v: False,
    "conversation": lambda v: False,
    "background": lambda v: v is False,
    "include": lambda v: v == [],
    "reasoning": lambda v: False,
    "truncation": lambda v: v == "disabled",
    "max_tool_calls": lambda v: False,
    "top_logprobs": lambda v: v == 0,
    "prompt": lambda v: False,
    "prompt_cache_retention": lambda v: False,
}
_WHY = {
    "store": " Responses are not stored on this server: omit 'store' or send false.",
    "previous_response_id": " Responses are not stored on this server: send the conversation in 'input'.",
    "conversation": " Responses are not stored on this server: send the conversation in 'input'.",
}
_ROLES = ("user", "system", "developer", "assistant")


@dataclass(frozen=True)
class ResponsesRequest(GenerationRequest):
    """A chat request, with what its response object repeats of the Responses body."""

    shape: rf.ResponseShape | None = None


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    _refuse_unserved(body)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _messages(body)
    chat["max_completion_tokens"] = int_field(body, "max_output_tokens", 1)
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if optional(body, "tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = _text(body)
    if text["format"]["type"] != "text":
        chat["response_format"] = _response_format(text["format"])
    if optional(body, "stream"):
        chat["stream_options"] = {"include_usage": True}  # the usage goes into response.completed
    try:
        req = parse_chat(chat)
    except APIError as e:
        raise _renamed(e) from None
    if req.grammar_param == "response_format":
        req = dataclasses.replace(req, grammar_param="text.format")
    shape = rf.ResponseShape(
        model=req.model, instructions=optional(body, "instructions"), max_output_tokens=req.max_tokens,
        temperature=req.sampling.temperature, top_p=req.sampling.top_p, tools=[_echo_tool(t) for t in tools or ()],
        tool_choice=optional(body, "tool_choice") or "auto", parallel_tool_calls=optional(body, "parallel_tool_calls")
        is not False, text=text, metadata=optional(body, "metadata") or {}, user=req.user)
    return ResponsesRequest(**{f.name: getattr(req, f.name) for f in dataclasses.fields(req)}, shape=shape)


def _refuse_unserved(body: dict) -> None:
    for name, value in body.items():
        if name in _PASSED or name in _READ or name in _NO_EFFECT or value is None and name in _UNSERVED_NO_OP:
            continue
        if name not in _UNSERVED_NO_OP:
            raise invalid_param(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
        if not _UNSERVED_NO_OP[name](value):
            raise invalid_param(name, f"The '{name}' parameter is not supported by this server.{_WHY.get(name, '')}",
                                "unsupported_parameter")
    options = optional(body, "stream_options")
    if options is not None:
        if not isinstance(options, dict) or not optional(body, "stream"):
            raise invalid_param("stream_options", "'stream_options' must be an object, and only with 'stream'.",
                                "invalid_value")
        for key, value in options.items():
            if not (key == "include_obfuscation" and value in (None, False)):
                raise invalid_param(f"stream_options.{key}", f"'stream_options.{key}' is not supported (no "
                                    "obfuscation padding is sent).", "unsupported_parameter")


def _messages(body: dict) -> list[dict]:
    instructions = optional(body, "instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_param("instructions", "Invalid type for 'instructions': expected a string.", "invalid_type")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    raw = optional(body, "input")
    if raw is None:
        raise invalid_param("input", "Missing required parameter: 'input'.", "missing_required_parameter")
    if isinstance(raw, str):
        return messages + [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid_param("input", "Invalid type for 'input': expected a string or a non-empty array of items.",
                            "invalid_type")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise invalid_param(f"input[{i}]", f"Invalid type for 'input[{i}]': expected an object.", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_input_message(i, item))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", f"input[{i}]"), "type": "function",
                    "function": {"name": _string(item, "name", f"input[{i}]"),
                                 "arguments": _string(item, "arguments", f"input[{i}]")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_parts(f"input[{i}].output", output)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", f"input[{i}]"),
                             "content": content})
        else:
            raise invalid_param(f"input[{i}].type", f"Invalid value for 'input[{i}].type': {kind!r} is not "
                                "supported; use message, function_call or function_call_output items.",
                                "unsupported_parameter")
    return messages


def _input_message(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid_param(f"input[{i}].role", f"Invalid value for 'input[{i}].role': {role!r}; expected one of "
                            f"{', '.join(_ROLES)}.", "invalid_value")
    content = item.get("content")
    if not isinstance(content, str):
        content = _text_parts(f"input[{i}].content", content)
    return {"role": role, "content": content}


def _text_parts(param: str, parts: Any) -> str:
    if not isinstance(parts, list):
        raise invalid_param(param, f"Invalid type for '{param}': expected a string or an array of content parts.",
                            "invalid_type")
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)):
            raise invalid_param(f"{param}[{j}]", f"Invalid content part in '{param}[{j}]': only 'input_text' and "
                                "'output_text' parts with a string 'text' are supported.", "invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, param: str) -> str:
    v = item.get(name)
    if not isinstance(v, str) or not v and name != "arguments":
        raise invalid_param(f"{param}.{name}", f"Missing required parameter: '{param}.{name}' (a string).",
                            "missing_required_parameter")
    return v


def _tools(body: dict) -> list[dict] | None:
    raw = optional(body, "tools")
    if raw is None or raw == []:  # chat has no empty tool list: no tools is the same request
        return None
    if not isinstance(raw, list):
        raise invalid_param("tools", "Invalid type for 'tools': expected an array.", "invalid_type")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid_param(f"tools[{i}].type", f"Invalid value for 'tools[{i}].type': {kind!r}; only "
                                "'function' tools are supported.", "unsupported_parameter")
        unknown = sorted(tool.keys() - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise invalid_param(f"tools[{i}].{unknown[0]}", f"Unrecognized argument 'tools[{i}].{unknown[0]}'.",
                                "unknown_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _echo_tool(chat_tool: dict) -> dict:
    fn = chat_tool["function"]
    return {"type": "function", "name": fn["name"], "description": fn.get("description"),
            "parameters": fn.get("parameters"), "strict": False}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid_param("tool_choice", "Invalid value for 'tool_choice': expected none, auto, required or "
                                "{\"type\": \"function\", \"name\": ...}.", "invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text(body: dict) -> dict:
    text = optional(body, "text")
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise invalid_param("text", "Invalid type for 'text': expected an object.", "invalid_type")
    for key, value in text.items():
        if key != "format" and value is not None:
            raise invalid_param(f"text.{key}", f"'text.{key}' is not supported by this server.",
                                "unsupported_parameter")
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, dict):
        raise invalid_param("text.format", "Invalid type for 'text.format': expected an object.", "invalid_type")
    return {"format": form}


def _response_format(form: dict) -> dict:
    """``text.format`` in chat's ``response_format`` form (the schema's fields sit one level up here)."""
    if form.get("type") != "json_schema":
        return form
    unknown = sorted(form.keys() - {"type", "name", "schema", "strict", "description"})
    if unknown:
        raise invalid_param(f"text.format.{unknown[0]}", f"Unrecognized argument 'text.format.{unknown[0]}'.",
                            "unknown_parameter")
    return {"type": "json_schema", "json_schema": {k: form.get(k) for k in ("name", "schema", "strict")}}


# The chat parser's parameter names, and what they are called in a Responses body.
_RENAMES = [
    (re.compile(r"^messages.*"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
]


def _renamed(e: APIError) -> APIError:
    if e.param is None:
        return e
    for pattern, name in _RENAMES:
        new = pattern.sub(name, e.param, count=1)
        if new != e.param:
            return APIError(e.status, e.message.replace(e.param, new), e.type, new, e.code, e.headers)
    return e


class ResponseGeneration(Generation):
    """A chat generation whose answer is framed as a Responses API object or event stream."""

    def __init__(self, admitted, stream, gateway, trace, shape: rf.ResponseShape) -> None:
        super().__init__(admitted, stream, gateway, trace)
        self.shape = shape

    async def collect(self, headers: dict[str, str] | None = None) -> Response:
        answer = await super().collect(headers)
        if answer.status_code != 200:
            return answer  # an error is already OpenAI-shaped
        return JSONResponse(rf.from_chat(self.shape, json.loads(answer.body)), headers=headers)

    async def sse(self) -> AsyncIterator[bytes]:
        events = rf.ResponseEvents(self.shape, self.admitted.request_id, self.created)
        async for data in super().sse():
            for payload in rf.split_frames(data):
                chunk = rf.parse_frame(payload)
                out = events.done() if chunk is None else events.feed(chunk)
                if out:
                    yield out


def _response_generation(admitted, stream, gw, trace, req: ResponsesRequest) -> Generation:
    return ResponseGeneration(admitted, stream, gw, trace, req.shape)


RESPONSES = Endpoint("chat", parse_responses, "resp_", "chat", _response_generation)


async def create_response(request: Request) -> Response:
    try:
        return await generate(request, RESPONSES)
    except APIError as e:  # the engine's checks name the chat request's parameters too
        raise _renamed(e) from None


routes = [Route("/v1/responses", create_response, methods=["POST"])]
