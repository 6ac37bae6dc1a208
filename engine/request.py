"""What a caller hands the engine, and the deltas it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.grammar import GrammarSpec


# Characters in one stop string. Matching costs each token the length of its own text, but a
# request's stop strings are still copied and indexed on the step loop's thread.
MAX_STOP_CHARS = 1000
# Tokens one request may bias (OpenAI's limit for logit_bias).
MAX_LOGIT_BIAS_TOKENS = 300
# Alternatives one token's logprobs or prompt logprobs may list (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest; 0 means off
    # OpenAI's penalties on the tokens generated so far: minus presence once a token has appeared,
    # minus frequency for each time it has. vLLM's repetition penalty (as HF's) over prompt and
    # output: a seen token's logit divided by it when positive, multiplied when negative.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # No EOS, stop token or stop string ends the output before this many tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # None: no logprobs; 0: the chosen token's only; k: plus the top k alternatives.
    logprobs: int | None = None
    # The same for every prompt token but the first (vLLM's prompt_logprobs, OpenAI's echo): how
    # likely the model found it after the tokens before it (engine/prompt_scoring.py).
    prompt_logprobs: int | None = None
    # Output constrained to a grammar (engine/grammar.py); None for free text.
    grammar: GrammarSpec | None = None
    n: int = 1  # choices sampled from each prompt (engine/choices.py)

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
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.min_tokens and self.grammar is not None:
            raise ValueError("min_tokens cannot be combined with a grammar, which may need to end sooner")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
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
    # A list prompt's entries after the first (OpenAI's completions take up to 2048): each runs as
    # ``params.n`` sequences of this one request, choices numbered prompt-major (engine/choices.py).
    more_prompts: tuple[list[int], ...] = ()
    # ``params.grammar`` already compiled (an xgrammar CompiledGrammar, engine/grammar_compiler.py):
    # the engine then builds its matcher without compiling; without it the engine compiles it first.
    compiled_grammar: object | None = None
    # False: never drafted for (speculative decoding, engine/speculative.py), e.g. to measure plain decoding.
    speculative: bool = True

    @property
    def prompts(self) -> tuple[list[int], ...]:
        return (self.prompt_token_ids, *self.more_prompts)

    @property
    def num_sequences(self) -> int:
        return self.params.n * (1 + len(self.more_prompts))


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None only for a prompt's first token, which nothing before it predicts
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, token, logprob) alternatives, likeliest first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt tokens only)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# A Delta's error when its grammar took longer than its budget for one token (engine/grammar.py: mask_logits).
MASK_OVER_BUDGET = "the grammar took longer than its time budget to compute the next token's mask"


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
    # On the first delta of a request that asked for prompt logprobs: one per prompt token.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    index: int = 0  # the choice it belongs to

    @property
    def is_last(self) -> bool:
        return self.usage is not None
