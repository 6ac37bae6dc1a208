"""Prompt-lookup drafting: guess a row's next tokens by finding its last few tokens earlier in its own text.

Outputs that copy their input (code edits, extraction, quoting) repeat long runs of the prompt, so
the tokens that followed the latest earlier occurrence of the current suffix are a good guess of
what comes next (Saxena's prompt lookup decoding; vLLM's ``ngram`` and llama.cpp's lookup do the
same). The index is kept incrementally, one dict entry per n-gram length per token, so a lookup
costs a few dict probes however long the row's text is; written here because no library keeps
one per row for a growing sequence.
"""

from __future__ import annotations


class NgramIndex:
    """The latest end position of every n-gram (``min_n`` to ``max_n`` tokens) of a growing token list."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = self.tokens
        # Index every n-gram but those ending at the last token: the suffix must match an earlier run.
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []
