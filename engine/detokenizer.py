"""Incremental detokenization and stop conditions for one request.

Text comes from tokenizers' own DecodeStream, which never yields half a
multi-byte character. Stop strings are matched on the decoded text; the tail
that could still grow into a stop string is held back until it cannot. Each stop
string is followed character by character with the Knuth-Morris-Pratt automaton,
so a token costs the length of its text, not of the text so far or of the stop
strings (written here because it is twenty lines and the per-token cost is what
keeps one request's stop strings from slowing the step loop for every other).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token decodes
# with the right leading space (sentencepiece-style tokenizers need context).
_PREFIX_CONTEXT_TOKENS = 6


class StopMatcher:
    """Where the text fed so far stands against one stop string: the length of the longest
    prefix of it that the text ends with (``matched``), advanced one character at a time."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        # fallback[n]: the longest proper prefix of stop[:n] that is also its suffix.
        self._fallback = [0] * (len(stop) + 1)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fallback[k]
            if stop[i] == stop[k]:
                k += 1
            self._fallback[i + 1] = k

    def feed(self, char: str) -> bool:
        """Advance by one character; True when the text now ends with the whole stop string."""
        k = self.matched
        if k == len(self.stop):
            k = self._fallback[k]
        while k and char != self.stop[k]:
            k = self._fallback[k]
        if char == self.stop[k]:
            k += 1
        self.matched = k
        return k == len(self.stop)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(prompt_token_ids[-_PREFIX_CONTEXT_TOKENS:], skip_special_tokens=True)
        self._stops = [StopMatcher(s) for s in stop if s]
        self._text = ""  # all decoded output text
        self._emitted = 0  # characters of _text already handed out
        self.stopped = False

    def add_token(self, token_id: int, may_stop: bool = True) -> str:
        """Feed one token; return the text that is now safe to emit. With ``may_stop`` false (the
        request's min_tokens not reached yet) a stop string it completes does not end the text."""
        piece = self._stream.step(self._tokenizer, token_id) or ""
        if not self._stops:
            self._text += piece
            return self._take(len(self._text))
        for i, char in enumerate(piece):
            done = [m for m in self._stops if m.feed(char)]
            if done and may_stop:
                # The text ends here; of stop strings completed by the same character, the
                # longest started first.
                self.stopped = True
                end = len(self._text) + i + 1 - max(len(m.stop) for m in done)
                self._text = (self._text + piece)[: max(end, self._emitted)]
                return self._take(len(self._text))
        self._text += piece
        return self._take(len(self._text) - max(m.matched for m in self._stops))

    def flush(self) -> str:
        """At finish, release whatever was held back for stop-string matching."""
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
