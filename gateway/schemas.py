"""Parsing and validation of OpenAI request bodies into plain dataclasses.

Everything a client can get wrong is caught here, as a 4xx naming the
parameter, before anything touches the rate limiter or the engine. As OpenAI
does, an argument we do not know is refused, and so is one we know but do not
serve (a penalty, a logit bias) unless it asks for its no-op default: a request
is never answered as if part of it had not been asked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import GrammarSpec
from engine.request import MAX_STOP_CHARS
from gateway.errors import APIError, invalid_param
from gateway.json_fields import bool_field, int_field, is_int, optional, str_field
from gateway.prompt_lists import check_sequences, parse_prompts
from gateway.response_format import parse_output_grammar, tool_grammar
from gateway.sampling import SAMPLING_FIELDS, Sampling, parse_sampling
from gateway.tools import ToolRequest, parse_tools

MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the KV pool
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[dict, ...] = ()  # an assistant's calls, OpenAI-shaped
    tool_call_id: str | None = None  # a tool message's answer to that call


@dataclass(frozen=True)
class ChatTemplateOptions:
    """vLLM's chat-template extensions: the generation prompt, continuing the last assistant message,
    and variables for the template (e.g. Qwen3's ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)


# Names the renderer itself takes: a template variable may not stand in for them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "return_assistant_tokens_mask", "bos_token", "eos_token",
})


@dataclass(frozen=True)
class GenerationRequest:
    """One chat or completion request, validated; ``prompt`` is text or token ids for completions."""

    kind: str  # "chat" or "completion"
    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] = ""
    more_prompts: tuple[str | tuple[int, ...], ...] = ()  # a list prompt's entries after the first
    max_tokens: int | None = None
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token plus k alternatives
    prompt_logprobs: int | None = None  # vLLM's extension: the same for each prompt token
    echo: bool = False  # completions: the prompt comes back before the completion (with logprobs, scored)
    user: str | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: benches ask for exact output lengths
    grammar: GrammarSpec | None = None  # from response_format, structured_outputs or tools
    grammar_param: str = "response_format"  # which, for a grammar that does not compile
    n: int = 1
    tools: ToolRequest | None = None
    stop_token_ids: tuple[int, ...] = ()  # vLLM's extension; checked against the vocabulary by the engine
    speculative: bool = True  # ours: false keeps the request out of speculative decoding (engine/speculative.py)
    template: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything that is not one, or that Python's json takes but we cannot use."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "We could not parse the JSON body of your request: it is nested too deeply.",
                       code="invalid_json") from None
    except ValueError as e:  # an integer literal past Python's 4300-digit conversion limit
        raise APIError(400, f"We could not parse the JSON body of your request: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    # A lone surrogate can only come from a \u escape (or a UTF-16/32 body, whose first bytes hold a
    # NUL); it is not Unicode, so neither a tokenizer, a database nor our UTF-8 error body could take it.
    if (b"\\u" in raw or b"\x00" in raw[:4]) and _has_lone_surrogate(body):
        raise APIError(400, "We could not parse the JSON body of your request: it contains an unpaired UTF-16 "
                       "surrogate escape (\\ud800 to \\udfff), which is not valid Unicode.", code="invalid_json")
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    pending = [value]  # a loop, not recursion: the body may be nested as deep as json.loads allows
    while pending:
        v = pending.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            pending.extend(v)
            pending.extend(v.values())
        elif isinstance(v, list):
            pending.extend(v)
    return False


def _stop(body: dict) -> tuple[str, ...]:
    v = optional(body, "stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid_param("stop", "Invalid type for 'stop': expected a string or an array of strings.", "invalid_type")
    if len(v) > MAX_STOP_SEQUENCES:
        raise invalid_param("stop", f"Invalid value for 'stop': at most {MAX_STOP_SEQUENCES} sequences are allowed.",
                            "invalid_value")
    if any(s == "" for s in v):
        raise invalid_param("stop", "Invalid value for 'stop': stop sequences must not be empty.", "invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise invalid_param("stop", f"Invalid value for 'stop': a stop sequence may have at most {MAX_STOP_CHARS} "
                            "characters.", "invalid_value")
    return tuple(v)


_SERVED_BY_BOTH = frozenset({
    "model", "n", "best_of", "stream", "stream_options", "stop", "user",
    "max_tokens", "max_completion_tokens", "logprobs", "response_format", "structured_outputs", "ignore_eos",
    "stop_token_ids", "prompt_logprobs", "speculative",
}) | SAMPLING_FIELDS
_SERVED = {
    "chat": _SERVED_BY_BOTH | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                               "chat_template_kwargs", "add_generation_prompt", "continue_final_message"},
    "completion": _SERVED_BY_BOTH | {"prompt", "suffix", "echo", "tools", "tool_choice"},
}
# Bookkeeping fields that change nothing in the answer: accepted and not used.
_NO_EFFECT = frozenset({"metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
# Known OpenAI arguments we do not serve; each is accepted only as null or as its no-op value.
_UNSERVED_NO_OP: dict[str, Callable[[Any], bool]] = {
    "store": lambda v: v is False,
    "modalities": lambda v: v == ["text"],
    **{name: lambda v: False for name in ("functions", "function_call", "audio", "prediction",
                                            "web_search_options", "reasoning_effort", "verbosity")},
}


def _refuse_unserved(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in _SERVED[kind] or name in _NO_EFFECT or value is None and name in _UNSERVED_NO_OP:
            continue
        if name not in _UNSERVED_NO_OP:
            raise invalid_param(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
        if not _UNSERVED_NO_OP[name](value):
            hint = " Use 'tools' and 'tool_choice' instead." if name in ("functions", "function_call") else ""
            raise invalid_param(name, f"The '{name}' parameter is not supported by this server.{hint}",
                                "unsupported_parameter")


def _common(body: dict) -> dict[str, Any]:
    model = optional(body, "model")
    if model is None:
        raise invalid_param("model", "You must provide a model parameter.", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid_param("model", "Invalid type for 'model': expected a non-empty string.", "invalid_type")
    n = int_field(body, "n", 1, MAX_CHOICES)
    if int_field(body, "best_of", 1) not in (None, 1):
        raise invalid_param("best_of", "Invalid value for 'best_of': best_of is not supported (ranking choices by "
                            "log probability); ask for several choices with 'n' instead.", "invalid_value")
    stream = bool_field(body, "stream")
    include_usage = False
    options = optional(body, "stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_param("stream_options", "Invalid type for 'stream_options': expected an object.",
                                "invalid_type")
        if not stream:
            raise invalid_param("stream_options", "The 'stream_options' parameter is only allowed when 'stream' "
                                "is enabled.", "invalid_value")
        include_usage = bool_field(options, "include_usage")
    prompt_logprobs = int_field(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise invalid_param("prompt_logprobs", "The 'prompt_logprobs' parameter is not available when 'stream' is "
                            "enabled.", "invalid_value")
    return dict(
        model=model,
        n=n or 1,
        sampling=parse_sampling(body),
        stop=_stop(body),
        user=str_field(body, "user"),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool_field(body, "ignore_eos"),
        speculative=bool_field(body, "speculative", default=True),
        stop_token_ids=_stop_token_ids(body),
        prompt_logprobs=prompt_logprobs,
    )


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = optional(body, "stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
        raise invalid_param("stop_token_ids", "Invalid type for 'stop_token_ids': expected an array of token ids.",
                            "invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_param("stop_token_ids", f"Invalid value for 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} "
                            "token ids are allowed.", "invalid_value")
    return tuple(ids)


def _template_options(body: dict) -> ChatTemplateOptions:
    variables = optional(body, "chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise invalid_param("chat_template_kwargs", "Invalid type for 'chat_template_kwargs': expected an object.",
                            "invalid_type")
    reserved = sorted(variables.keys() & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise invalid_param("chat_template_kwargs", f"Invalid value for 'chat_template_kwargs': {reserved[0]!r} is "
                            "set by the server (use the request's own field where there is one).", "invalid_value")
    options = ChatTemplateOptions(add_generation_prompt=bool_field(body, "add_generation_prompt", True),
                                  continue_final_message=bool_field(body, "continue_final_message"),
                                  variables=variables)
    if options.add_generation_prompt and options.continue_final_message:
        raise invalid_param("continue_final_message", "'continue_final_message' requires 'add_generation_prompt' "
                            "to be false.", "invalid_value")
    return options


def _message_content(i: int, content: Any) -> str:
    param = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid_param(f"{param}[{j}]", f"Invalid content part in '{param}[{j}]': only parts of "
                                    "type 'text' with a string 'text' are supported.", "invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid_param(param, f"Invalid type for '{param}': expected a string or an array of content parts.",
                        "invalid_type")


def _messages(body: dict) -> tuple[Message, ...]:
    raw = optional(body, "messages")
    if raw is None:
        raise invalid_param("messages", "Missing required parameter: 'messages'.", "missing_required_parameter")
    if not isinstance(raw, list):
        raise invalid_param("messages", "Invalid type for 'messages': expected an array.", "invalid_type")
    if not raw:
        raise invalid_param("messages", "Invalid 'messages': empty array; expected at least one message.",
                            "empty_array")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid_param(f"messages[{i}]", f"Invalid type for 'messages[{i}]': expected an object.",
                                "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid_param(f"messages[{i}].role", f"Invalid value for 'messages[{i}].role': {role!r}; "
                                f"expected one of {', '.join(CHAT_ROLES)}.", "invalid_value")
        out.append(Message(role=role, content=_message_content(i, m.get("content")),
                           tool_calls=_tool_calls(i, m) if role == "assistant" else (),
                           tool_call_id=_tool_call_id(i, m) if role == "tool" else None))
    return tuple(out)


def _tool_calls(i: int, message: dict) -> tuple[dict, ...]:
    raw = message.get("tool_calls")
    if raw is None:
        return ()
    param = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise invalid_param(param, f"Invalid type for '{param}': expected an array.", "invalid_type")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(call.get("id"), str) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)):
            raise invalid_param(f"{param}[{j}]", f"Invalid value for '{param}[{j}]': expected an object with a "
                                "string 'id' and a 'function' with string 'name' and 'arguments'.", "invalid_value")
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return tuple(calls)


def _tool_call_id(i: int, message: dict) -> str:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_param(f"messages[{i}].tool_call_id", f"Missing required parameter: "
                            f"'messages[{i}].tool_call_id'.", "missing_required_parameter")
    return call_id


def _max_tokens(body: dict) -> int | None:
    by_new_name = int_field(body, "max_completion_tokens", 1)
    return by_new_name if by_new_name is not None else int_field(body, "max_tokens", 1)


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    _refuse_unserved(body, "chat")
    common = _common(body)
    messages = _messages(body)
    logprobs = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.", "invalid_value")
    tools = parse_tools(body)
    grammar, grammar_param = parse_output_grammar(body)
    if tools is not None and tools.choice != "none" and grammar is not None:
        raise invalid_param(grammar_param, f"'{grammar_param}' other than text cannot be combined with "
                            "tools unless 'tool_choice' is 'none'.", "invalid_value")
    if tools is not None and tools.choice != "none":
        grammar, grammar_param = tool_grammar(tools), "tools"
    return GenerationRequest(
        kind="chat",
        messages=messages,
        tools=tools,
        grammar=grammar,
        grammar_param=grammar_param,
        max_tokens=_max_tokens(body),
        logprobs=(top or 0) if logprobs else None,
        template=_template_options(body),
        **common,
    )


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    _refuse_unserved(body, "completion")
    common = _common(body)
    if optional(body, "suffix") is not None:
        raise invalid_param("suffix", "The 'suffix' parameter is not supported.", "invalid_value")
    for name in ("tools", "tool_choice"):
        if optional(body, name) is not None:
            raise invalid_param(name, f"'{name}' is only supported on /v1/chat/completions.", "invalid_value")
    grammar, grammar_param = parse_output_grammar(body)
    prompts = parse_prompts(body)
    check_sequences(len(prompts), common["n"])
    return GenerationRequest(
        kind="completion",
        grammar=grammar,
        grammar_param=grammar_param,
        prompt=prompts[0],
        more_prompts=prompts[1:],
        max_tokens=_max_tokens(body),
        logprobs=int_field(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS),
        echo=bool_field(body, "echo"),
        **common,
    )
