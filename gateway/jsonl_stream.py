"""A JSONL file read as it streams: numbered lines cut from chunks as they arrive, and the upload's check of them.

Both the upload (gateway/files_api.py, from the spooled multipart part) and a batch's validation
(gateway/batch_validation.py, from the file's chunks in the database) read a file this way, so
neither holds more than a chunk and one line: a line longer than a request body can be (no line of
a batch may be) is a 400 before it is buffered whole. Lines are numbered from 1, blank ones
included, as OpenAI's errors object names them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from gateway.errors import invalid_param

# A line holds a request body plus its envelope (custom_id, method, url).
ENVELOPE_BYTES = 64 * 1024


class LineSplitter:
    """Cuts a byte stream into numbered lines; ``feed`` a chunk, then ``close`` for the last line."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.number = 0
        self._partial = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        lines = []
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._partial += chunk[start:end]
            lines.append(self._take())
            start = end + 1
        self._partial += chunk[start:]
        self._bound(len(self._partial))
        return lines

    def close(self) -> list[tuple[int, bytes]]:
        return [self._take()] if self._partial else []

    def _take(self) -> tuple[int, bytes]:
        self._bound(len(self._partial))
        self.number += 1
        line = bytes(self._partial.removesuffix(b"\r"))
        self._partial.clear()
        return self.number, line

    def _bound(self, size: int) -> None:
        if size > self.max_line_bytes:
            raise invalid_param("file", f"Line {self.number + 1} is longer than {self.max_line_bytes} bytes, more "
                                "than a request may be.", "line_too_long")


def numbered_lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """Every line of the stream, numbered, a chunk read at a time."""
    splitter = LineSplitter(max_line_bytes)
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.close()


class JsonlCheck:
    """An upload's check as its chunks go by: every line a JSON object, at most ``max_lines`` of them (blank lines
    aside), at least one; a 400 naming the first line at fault."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines = max_lines
        self.count = 0
        self._splitter = LineSplitter(max_line_bytes)

    def passing(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """``chunks`` unchanged, each checked before it is passed on; the last check when they end."""
        for chunk in chunks:
            self._check(self._splitter.feed(chunk))
            yield chunk
        self._check(self._splitter.close())
        if self.count == 0:
            raise invalid_param("file", "The file is empty: a batch's input needs at least one line.", "empty_file")

    def _check(self, lines: list[tuple[int, bytes]]) -> None:
        for number, raw in lines:
            if not raw.strip():
                continue
            self.count += 1
            if self.count > self.max_lines:
                raise invalid_param("file", f"The file has more than {self.max_lines} lines, the limit of a batch's "
                                    "input.", "too_many_lines")
            try:
                line = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise invalid_param("file", f"The file is not valid JSONL: line {number} is not JSON.",
                                    "invalid_jsonl") from None
            if not isinstance(line, dict):
                raise invalid_param("file", f"The file is not valid JSONL: line {number} is not a JSON object.",
                                    "invalid_jsonl")
