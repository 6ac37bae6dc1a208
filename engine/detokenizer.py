"""Incremental detokenization and stop conditions for one request.

Text comes from tokenizers' own DecodeStream, which never yields half a
multi-byte character. Stop strings are matched on the decoded text; the tail
that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token decodes
# with the right leading space (sentencepiece-style tokenizers need context).
_PREFIX_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(prompt_token_ids[-_PREFIX_CONTEXT_TOKENS:], skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # all decoded output text
        self._emitted = 0  # characters of _text already handed out
        self.stopped = False

    def add_token(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece:
            self._text += piece
        if not self._stop:
            return self._take(len(self._text))
        search_from = max(0, self._emitted - max(len(s) for s in self._stop))
        hits = [i for s in self._stop if (i := self._text.find(s, search_from)) != -1]
        if hits:
            self.stopped = True
            self._text = self._text[: min(hits)]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        """At finish, release whatever was held back for stop-string matching."""
        return self._take(len(self._text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), 0, -1):
                if self._text.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return longest

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
