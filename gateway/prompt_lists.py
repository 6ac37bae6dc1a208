"""List prompts on /v1/completions: `prompt` as an array of strings or of token-id arrays.

OpenAI's and vLLM's completions take up to 2048 prompts in one request, and
evaluation harnesses send them so. Every entry becomes a prompt of the one
engine request (engine/choices.py runs it as ``n`` sequences, choices indexed
prompt-major), so a list costs one RPM unit, one concurrency lease, one ledger
row and one TPM reservation of the sum of its prompts plus ``n`` times
``max_tokens`` per prompt. What it may cost is bounded before anything runs:
the number of entries and of sequences here, the sum of their tokens by
characters before tokenizing and by tokens after.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError, invalid_param
from gateway.json_fields import is_int, optional

Prompt = str | tuple[int, ...]

MAX_PROMPTS = 2048  # OpenAI's limit on a list prompt's entries
MAX_SEQUENCES = 2048  # entries times n: each is a sequence in the engine's queue


def parse_prompts(body: dict[str, Any]) -> tuple[Prompt, ...]:
    """``prompt`` as its entries: a string, token ids, or an array of either (not mixed); 400 naming it."""
    raw = optional(body, "prompt")
    if raw is None:
        raise invalid_param("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter")
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list) or not raw:
        raise invalid_param("prompt", "Invalid type for 'prompt': expected a string, an array of token ids, or a "
                            "non-empty array of strings or of token-id arrays.", "invalid_type")
    if all(is_int(t) for t in raw):
        return (_token_ids(raw, "prompt"),)
    if len(raw) > MAX_PROMPTS:
        raise invalid_param("prompt", f"Invalid value for 'prompt': at most {MAX_PROMPTS} prompts are allowed in "
                            f"one request; this one has {len(raw)}.", "invalid_value")
    if all(isinstance(p, str) for p in raw):
        return tuple(raw)
    if all(isinstance(p, list) for p in raw):
        return tuple(_token_ids(p, f"prompt[{i}]") for i, p in enumerate(raw))
    raise invalid_param("prompt", "Invalid type for 'prompt': an array prompt holds only strings or only token-id "
                        "arrays.", "invalid_type")


def check_sequences(prompts: int, n: int) -> None:
    """A list of ``prompts`` entries with ``n`` choices each must fit the bound on one request's sequences."""
    if prompts * n > MAX_SEQUENCES:
        raise invalid_param("n", f"Invalid value for 'n': {prompts} prompts with n={n} make {prompts * n} choices; "
                            f"one request may have at most {MAX_SEQUENCES}.", "invalid_value")


def _token_ids(raw: list, param: str) -> tuple[int, ...]:
    if not raw:
        raise invalid_param(param, f"Invalid value for '{param}': the prompt is empty.", "invalid_value")
    if not all(is_int(t) and t >= 0 for t in raw):
        raise invalid_param(param, f"Invalid type for '{param}': expected an array of token ids (non-negative "
                            "integers).", "invalid_type")
    return tuple(raw)


async def list_token_ids(encoder, prompts: tuple[Prompt, ...], max_total_tokens: int) -> list[list[int]]:
    """Each entry's token ids, tokenized off the event loop by ``encoder`` (gateway/prompts.py); 400 for an
    entry that is empty or cannot fit the context, or a list whose tokens sum past ``max_total_tokens``."""
    texts = [p for p in prompts if isinstance(p, str)]
    # No token is longer than max_token_chars: this many tokens at least, known without tokenizing.
    fewest = sum(len(p) for p in prompts if not isinstance(p, str)) + sum(
        -(-len(t) // encoder.tokenizer.max_token_chars) for t in texts)
    _check_total(fewest, max_total_tokens)
    for i, p in enumerate(prompts):
        if isinstance(p, str) and len(p) > encoder.max_chars:
            raise APIError(400, f"This model's maximum context length is {encoder.max_model_len} tokens, and no "
                           f"prompt of more than {encoder.max_chars} characters fits in it; prompt[{i}] has "
                           f"{len(p)}. Please reduce the length of the prompt.", param="prompt",
                           code="context_length_exceeded")
    encoded = iter(await encoder.encode_texts(texts))
    ids = [list(p) if not isinstance(p, str) else next(encoded) for p in prompts]
    vocab = encoder.tokenizer.vocab_size
    for i, p in enumerate(ids):
        if not p:
            raise invalid_param("prompt", f"Invalid value for 'prompt': prompt[{i}] is empty.", "invalid_value")
        if max(p) >= vocab:
            raise invalid_param("prompt", f"Prompt token ids must be smaller than the vocabulary size {vocab} "
                                f"(prompt[{i}]).", "invalid_value")
    _check_total(sum(map(len, ids)), max_total_tokens)
    return ids


def _check_total(tokens: int, bound: int) -> None:
    if tokens > bound:
        raise invalid_param("prompt", f"Invalid value for 'prompt': the prompts hold {tokens} tokens together; one "
                            f"request may hold at most {bound}. Send them in several requests.", "invalid_value")
