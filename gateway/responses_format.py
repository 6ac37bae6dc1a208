"""OpenAI's Responses API objects, built from the chat framing of the same generation.

A `/v1/responses` request runs as a chat request (gateway/responses_api.py); its answer is the chat
completion's (gateway/generation.py) reframed here: the whole response from the chat response, the
typed stream events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ..., ``response.completed``) from the chat stream's chunks, in the
order the official client's stream accumulator checks. Pure functions of those objects, so the
shapes can be checked without a model.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from gateway import openai_format as fmt


@dataclass(frozen=True)
class ResponseShape:
    """What a response object repeats of its request (OpenAI echoes these fields back)."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict = field(default_factory=dict)
    user: str | None = None

    def response(self, response_id: str, created: int, status: str, output: list[dict],
                 usage: dict | None = None, error: dict | None = None, incomplete: str | None = None) -> dict:
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": self.temperature, "text": self.text,
            "tool_choice": self.tool_choice, "tools": self.tools, "top_p": self.top_p, "truncation": "disabled",
            "usage": usage, "user": self.user, "metadata": self.metadata,
        }


def usage(chat_usage: dict) -> dict:
    """A chat usage object in the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _message(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status and incomplete reason for a chat finish reason."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def from_chat(shape: ResponseShape, chat: dict) -> dict:
    """The whole response for a whole chat completion (n is 1)."""
    choice = chat["choices"][0]
    status, incomplete = _status(choice["finish_reason"])
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(_message(message["content"], status))
    for call in message.get("tool_calls") or ():
        output.append(_function_call(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    return shape.response(chat["id"], chat["created"], status, output, usage(chat["usage"]), incomplete=incomplete)


class ResponseEvents:
    """Turns one chat stream's chunks into the Responses API's stream events (SSE bytes)."""

    def __init__(self, shape: ResponseShape, response_id: str, created: int) -> None:
        self.shape = shape
        self.response_id = response_id
        self.created = created
        self.sequence = 0
        self.output: list[dict] = []  # items, the last one open while ``open``
        self.open = False
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.started = False
        self.ended = False

    def feed(self, chunk: dict) -> bytes:
        """The events one chat chunk makes (the first also opens the response)."""
        out = [] if self.started else self._start()
        if "error" in chunk:
            out += self._fail(chunk["error"])
        elif not chunk.get("choices"):
            self.usage = chunk.get("usage") or self.usage
        else:
            choice = chunk["choices"][0]
            delta = choice.get("delta", {})
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                out += self._close()
            if chunk.get("usage"):
                self.usage = chunk["usage"]
        return b"".join(out)

    def done(self) -> bytes:
        """The stream's end: the last open item closes, then ``response.completed`` (or ``.incomplete``)."""
        if self.ended:
            return b""
        self.ended = True
        out = self._close()
        status, incomplete = _status(self.finish_reason)
        response = self.shape.response(self.response_id, self.created, status, self.output,
                                       usage(self.usage) if self.usage else None, incomplete=incomplete)
        out.append(self._event(f"response.{status}", response=response))
        return b"".join(out)

    # -- events -------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + fmt.sse(obj)

    def _start(self) -> list[bytes]:
        self.started = True
        response = self.shape.response(self.response_id, self.created, "in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _fail(self, error: dict) -> list[bytes]:
        out = self._close()
        self.ended = True
        failure = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        response = self.shape.response(self.response_id, self.created, "failed", self.output, error=failure)
        return out + [self._event("response.failed", response=response)]

    def _add(self, item: dict) -> list[bytes]:
        out = self._close()
        self.output.append(item)
        self.open = True
        return out + [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        item = self.output[-1] if self.open else None
        if item is None or item["type"] != "message":
            item = _message("", "in_progress")
            part = item["content"][0]
            item["content"] = []
            out += self._add(item)
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={**part, "text": ""}))
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, piece: dict) -> list[bytes]:
        out: list[bytes] = []
        fn = piece.get("function", {})
        if piece.get("id"):  # a new call: its id and name first, then pieces of its arguments
            out += self._add(_function_call(piece["id"], fn.get("name", ""), "", "in_progress"))
        item = self.output[-1]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.output) - 1, delta=fn["arguments"]))
        return out

    def _close(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        index, item = len(self.output) - 1, self.output[-1]
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            item["status"] = _status(self.finish_reason)[0] if self.finish_reason else "completed"
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        else:
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out


def split_frames(data: bytes) -> list[bytes]:
    """The JSON payloads of the ``data:`` events in a piece of a chat SSE stream (``[DONE]`` included)."""
    return [frame[len(b"data: "):] for frame in data.split(b"\n\n") if frame.startswith(b"data: ")]


def parse_frame(payload: bytes) -> dict | None:
    """A chat chunk; None for the stream's ``[DONE]``."""
    return None if payload == b"[DONE]" else json.loads(payload)
