"""The model's answer to a request with tools: content and tool calls, whole or as they stream.

The call grammar (``gateway/tools.py``) makes every call the model writes take one form::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is given out whole, once the ``}`` that closes the object around its
arguments is written and the arguments are JSON: a stream sends it as one
``delta.tool_calls`` item (id, type, name and arguments), which OpenAI's clients
read as they read a call sent in pieces. Held back until then, a call cut by
max_tokens (finish_reason ``length``) is never given out as a call with arguments
that are not JSON, which a client would run or send back in its history: its text
comes back as content, as vLLM's parsers do, streamed or not. Text that could
still be the start of a call is held back until it is known either way.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from gateway.tools import CALL_ARGUMENTS, CALL_END, CALL_NAME, CALL_NAMED, CALL_OPEN

_HEADER = re.compile(re.escape(CALL_NAMED) + f"({CALL_NAME})" + re.escape(CALL_ARGUMENTS))


def _proper_prefixes(literal: str) -> str:
    return "|".join(re.escape(literal[:i]) for i in range(len(literal)))


# Any text that may still grow into a header: a start of the lead, the lead and a name, or the
# lead, a name and a start of what follows it.
_HEADER_START = re.compile(f"(?:{_proper_prefixes(CALL_NAMED)})"
                           f"|{re.escape(CALL_NAMED)}[A-Za-z0-9_-]{{0,64}}"
                           f"|{re.escape(CALL_NAMED)}{CALL_NAME}(?:{_proper_prefixes(CALL_ARGUMENTS)})")

# A piece of the answer, in order: content text, or one item of OpenAI's ``delta.tool_calls``.
Piece = str | dict


@dataclass
class ToolCallParser:
    """Splits generated text into content and whole tool calls as it streams in."""

    calls: list[dict] = field(default_factory=list)  # every whole call so far
    _pending: str = ""
    _state: str = "text"  # text, header (after CALL_OPEN), arguments, tail (after the arguments)
    _call: str = ""  # the text of the call under way, given back as content if it is cut
    _name: str = ""
    _arguments: str = ""
    _depth: int = 0  # of brackets inside the arguments
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[Piece]:
        """The pieces that ``text``, the next part of the output, completes."""
        self._pending += text
        pieces: list[Piece] = []
        while self._advance(pieces):
            pass
        return self._without_separators(pieces)

    def finish(self) -> list[Piece]:
        """Whatever is held back when the output ends (cut by max_tokens): a call's unfinished text is content."""
        rest, state = self._pending, self._state
        self._pending, self._state = "", "text"
        if state == "header":
            rest = CALL_OPEN + rest
        elif state == "arguments":
            rest = self._call + rest
        return self._without_separators([rest] if rest and state != "tail" else [])

    def _advance(self, pieces: list[Piece]) -> bool:
        """Consume what the current state can; whether the state changed (so there may be more to do)."""
        step = {"text": self._text, "header": self._header, "arguments": self._read_arguments, "tail": self._tail}
        return step[self._state](pieces)

    def _text(self, pieces: list[Piece]) -> bool:
        start = self._pending.find(CALL_OPEN)
        if start < 0:
            start = len(self._pending) - _partial_suffix(self._pending, CALL_OPEN)
        if start:
            pieces.append(self._pending[:start])
        if not self._pending.startswith(CALL_OPEN, start):
            self._pending = self._pending[start:]
            return False
        self._pending = self._pending[start + len(CALL_OPEN):]
        self._state = "header"
        return True

    def _header(self, pieces: list[Piece]) -> bool:
        match = _HEADER.match(self._pending)
        if match is None:
            if _HEADER_START.fullmatch(self._pending):
                return False
            pieces.append(CALL_OPEN)  # not a call after all: it stays text
            self._state = "text"
            return True
        self._call, self._name, self._arguments = CALL_OPEN + match.group(0), match.group(1), ""
        self._pending = self._pending[match.end():]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _read_arguments(self, pieces: list[Piece]) -> bool:
        text = self._pending
        end = self._arguments_end(text)
        self._call += text[:end]
        self._arguments += text[:end]
        self._pending = text[end:]
        if end == len(text):
            return False
        if is_json(self._arguments):
            call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                    "function": {"name": self._name, "arguments": self._arguments}}
            self.calls.append(call)
            pieces.append({"index": len(self.calls) - 1, **call, "function": dict(call["function"])})
            self._state = "tail"
        else:  # not the form the grammar writes: the block is content
            pieces.append(self._call)
            self._state = "text"
        self._call = self._arguments = ""
        return True

    def _tail(self, pieces: list[Piece]) -> bool:
        """After the arguments: the object around them closes, then the block."""
        if self._pending.startswith(CALL_END):
            self._pending = self._pending[len(CALL_END):]
        elif CALL_END.startswith(self._pending):
            return False
        # else not the form the grammar writes: what follows is content
        self._state = "text"
        return True

    def _arguments_end(self, text: str) -> int:
        """Where the arguments end in ``text``: at the first ``}`` outside strings and brackets, else its length."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:
                    return i
                self._depth -= 1
        return len(text)

    def _without_separators(self, pieces: list[Piece]) -> list[Piece]:
        # Once there is a call, whitespace between blocks is the grammar's separator, not an answer.
        if not self.calls:
            return pieces
        return [p for p in pieces if not isinstance(p, str) or p.strip()]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None, calls); the same calls a stream of it gives."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    if parser.calls:
        content = content.strip()
    return (content if content or not parser.calls else None), parser.calls


def finish_reason_with_calls(reason: str | None, calls: list) -> str | None:
    """A choice that stopped after making tool calls finishes with ``tool_calls``, as OpenAI's do."""
    return "tool_calls" if reason == "stop" and calls else reason
