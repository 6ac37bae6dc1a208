"""What a caller hands the engine, and the deltas it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.grammar import GrammarSpec


# Characters in one stop string. Matching costs each token the length of its own text, but a
# request's stop strings are still copied and indexed on the step loop's thread.
MAX_STOP_CHARS = 1000


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs; 0: the chosen token's only; k: plus the top k alternatives.
    logprobs: int | None = None
    # Output constrained to a grammar (engine/grammar.py); None for free text.
    grammar: GrammarSpec | None = None
    n: int = 1  # choices sampled from the one prompt (engine/choices.py)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be non-negative")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tier: str = "standard"
    adapter: str | None = None
    # Opaque: whose request it is, for fair share in its tier and the prefix cache's scope.
    tenant: str | None = None
    tenant_weight: float = 1.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, token, logprob) alternatives


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """New output of one request since the last delta.

    ``text`` never ends in half a multi-byte character; text that might be the
    start of a stop string is held back until it is known not to be.
    A choice's last delta has ``finish_reason`` ("stop", "length", "abort", "error");
    the request's last delta also has ``usage`` (for n > 1, of all its choices).
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    index: int = 0  # the choice it belongs to

    @property
    def is_last(self) -> bool:
        return self.usage is not None
