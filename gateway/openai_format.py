"""OpenAI response objects: whole responses, stream chunks, SSE framing, logprobs and usage.

Pure functions of the engine's deltas, so the shapes can be checked without a model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from engine.request import TokenLogprob, Usage

DONE = b"data: [DONE]\n\n"
# Characters that some clients' line splitting (Python's str.splitlines, so httpx's iter_lines) takes
# for line breaks although SSE does not; JSON only allows them inside strings, where an escape means
# the same, so every reader sees an event as one line.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict) -> bytes:
    """One Server-Sent Event carrying ``obj`` as compact JSON (one line, so no field splitting is needed)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:  # rare: scanning is cheaper than translating
        text = text.translate(_UNICODE_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


def usage_dict(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict:
    content = [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": _token_bytes(lp.token),
            "top_logprobs": [{"token": t, "logprob": p, "bytes": _token_bytes(t)} for _, t, p in lp.top],
        }
        for lp in items
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], text_offset_start: int) -> dict:
    offsets, offset = [], text_offset_start
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        # A prompt's first token has neither logprob nor alternatives: null, as OpenAI's echo gives it.
        "top_logprobs": [None if lp.logprob is None else {t: p for _, t, p in lp.top} for lp in items],
        "text_offset": offsets,
    }


def echo_items(prompt_scores: Sequence[TokenLogprob], top: int) -> list[TokenLogprob]:
    """The prompt's tokens as ``echo`` lists them: with as many alternatives as the completion's."""
    return [dataclasses.replace(s, top=s.top[:top]) for s in prompt_scores]


def echoed_completion_logprobs(prompt_scores: Sequence[TokenLogprob], top: int, echo_len: int,
                               items: Sequence[TokenLogprob]) -> dict:
    """A completion's logprobs after its echoed prompt: the prompt's tokens first, the completion's
    offsets counted from the end of the echoed text."""
    head = completion_logprobs(echo_items(prompt_scores, top), 0)
    tail = completion_logprobs(items, echo_len)
    return {key: head[key] + tail[key] for key in head}


def prompt_logprobs(prompt_scores: Sequence[TokenLogprob], top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: null for the first token, then by token id (a string, as JSON keys are)
    the prompt token's and its ``top`` alternatives' logprob, rank and text."""
    out: list[dict | None] = [None]
    for s in prompt_scores[1:]:
        entry = {str(s.token_id): {"logprob": s.logprob, "rank": s.rank, "decoded_token": s.token}}
        for rank, (token_id, token, logprob) in enumerate(s.top[:top], start=1):
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": token})
        out.append(entry)
    return out


def finish_reason(reason: str | None) -> str | None:
    # The engine also ends requests with "abort"/"error"; clients know only stop, length and tool_calls.
    return reason if reason in (None, "stop", "length", "tool_calls") else "stop"


def chat_choice(index: int, text: str | None, reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def completion_choice(index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_response(request_id: str, created: int, model: str, choices: list[dict], usage: Usage) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(usage)}


def completion_response(request_id: str, created: int, model: str, choices: list[dict], usage: Usage) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(usage)}


class ChunkWriter:
    """Frames one request's deltas as OpenAI stream chunks (SSE bytes)."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
        }
        self.include_usage = include_usage
        self.text_offsets: dict[int, int] = {}  # by choice index

    def _chunk(self, choice: dict) -> bytes:
        obj = {**self.base, "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return sse(obj)

    def first(self, index: int = 0) -> bytes:
        """Chat streams open each choice with the assistant role, as OpenAI's do; completions have no such chunk."""
        if self.kind != "chat":
            return b""
        return self._chunk(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def delta(self, text: str, logprobs: Sequence[TokenLogprob], want_logprobs: bool,
              reason: str | None = None, index: int = 0) -> bytes:
        if not text and not logprobs and reason is None:
            return b""
        offset = self.text_offsets.get(index, 0)
        if self.kind == "chat":
            lp = chat_logprobs(logprobs) if want_logprobs and logprobs else None
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": lp,
                      "finish_reason": finish_reason(reason)}
        else:
            lp = completion_logprobs(logprobs, offset) if want_logprobs and logprobs else None
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason(reason)}
        self.text_offsets[index] = offset + len(text)
        return self._chunk(choice)

    def tool_call(self, item: dict, index: int = 0) -> bytes:
        """One item of ``delta.tool_calls``: a call's id, type and name first, then pieces of its
        arguments; OpenAI's clients join the pieces by the item's ``index``."""
        return self._chunk({"index": index, "delta": {"tool_calls": [item]}, "logprobs": None,
                            "finish_reason": None})

    def usage(self, usage: Usage) -> bytes:
        if not self.include_usage:
            return b""
        return sse({**self.base, "choices": [], "usage": usage_dict(usage)})
