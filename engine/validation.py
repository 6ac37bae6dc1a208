"""The checks a request must pass before the engine takes it: one definition, for the engine and the gateway.

The gateway runs them before it reserves any of a tenant's limits (and turns a failure into a
400 with the error's ``param`` and ``code``); the engine runs them again when the request is
submitted, so nothing invalid reaches the step loop whoever the caller.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields

from engine.request import EngineRequest, SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


class InvalidRequest(ValueError):
    """A request the engine cannot serve; ``param`` and ``code`` say which part, as an API error would."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    tier_capacity: Mapping[str, int]  # tokens a request of each tier can hold in the KV cache
    vocab_size: int

    def check(self, request: EngineRequest, adapters: Collection[str]) -> None:
        """Raise InvalidRequest naming the first problem of ``request``."""
        max_tokens = request.params.max_tokens
        # A list prompt's longest entry is the one that must fit.
        prompt_len = max(len(p) for p in request.prompts)
        if min(len(p) for p in request.prompts) == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if prompt_len >= self.max_model_len or prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, {max(max_tokens, 1)} for "
                "the completion). Please reduce the length of the prompt or completion.",
                "max_tokens", "context_length_exceeded")
        try:
            request.params.validate()
        except ValueError as e:
            # SamplingParams.validate's messages start with the field they are about.
            first_word = str(e).split(maxsplit=1)[0]
            raise InvalidRequest(str(e), first_word if first_word in SAMPLING_FIELDS else None) from None
        if not 0 < request.tenant_weight < float("inf"):
            raise InvalidRequest(f"a tenant's weight must be positive and finite, not {request.tenant_weight!r}")
        fits = self.tier_capacity.get(request.tier)
        if fits is None:
            raise InvalidRequest(f"unknown tier {request.tier!r}")
        if prompt_len + max_tokens > fits:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the {fits} tokens a "
                f"{request.tier} request can hold in this server's KV cache", "max_tokens")
        if any(min(p) < 0 or max(p) >= self.vocab_size for p in request.prompts):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if any(not 0 <= token < self.vocab_size for token, _ in request.params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if any(not 0 <= token < self.vocab_size for token in request.params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        if request.adapter is not None and request.adapter not in adapters:
            raise InvalidRequest(f"unknown adapter {request.adapter!r}", "model")
