"""Per-request sampling of the step's logits: greedy, temperature, top-k, top-p, seeds, logprobs.

Each request owns a torch.Generator, so a seeded request draws the same
tokens whatever else shares its batch. Greedy rows are taken in one batched
argmax; only rows that really sample pay for a per-row draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.request import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token, when asked for
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own random stream; None for greedy decoding, which draws nothing."""
    if params.temperature <= 0:
        return None  # a Generator costs several microseconds on the request path, for nothing here
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return generator


def _filtered_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = row_logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ([rows, vocab], float32)."""
    logits = logits.float().cpu()
    token_ids = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.temperature > 0:
            probs = _filtered_probs(logits[row], p)
            token_ids[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())

    wants_logprobs = [row for row, p in enumerate(params) if p.logprobs is not None]
    results = [SampledToken(t) for t in token_ids]
    if wants_logprobs:
        logprobs = torch.log_softmax(logits[wants_logprobs], dim=-1)
        for i, row in enumerate(wants_logprobs):
            chosen = token_ids[row]
            results[row].logprob = float(logprobs[i, chosen])
            k = params[row].logprobs or 0
            if k:
                values, ids = torch.topk(logprobs[i], k)
                results[row].top = tuple(zip(ids.tolist(), values.tolist()))
    return results
