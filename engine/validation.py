"""Checks a request must pass before the engine takes it: nothing invalid reaches the step loop."""

from __future__ import annotations

from collections.abc import Collection

from engine.request import EngineRequest


def validate_request(
    request: EngineRequest,
    max_model_len: int,
    tier_capacity: dict[str, int],
    vocab_size: int,
    adapters: Collection[str],
) -> None:
    """Raise ValueError naming the problem; ``tier_capacity`` maps each tier to the tokens it can hold."""
    request.params.validate()
    prompt_len = len(request.prompt_token_ids)
    wanted = prompt_len + request.params.max_tokens
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if wanted > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus max_tokens ({request.params.max_tokens}) "
            f"exceeds the context length of {max_model_len} tokens"
        )
    if not 0 < request.tenant_weight < float("inf"):
        raise ValueError(f"a tenant's weight must be positive and finite, not {request.tenant_weight!r}")
    if request.tier not in tier_capacity:
        raise ValueError(f"unknown tier {request.tier!r}")
    fits = tier_capacity[request.tier]
    if wanted > fits:
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus max_tokens ({request.params.max_tokens}) exceeds the "
            f"{fits} tokens a {request.tier} request can hold in this server's KV cache"
        )
    if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if request.adapter is not None and request.adapter not in adapters:
        raise ValueError(f"unknown adapter {request.adapter!r}")
