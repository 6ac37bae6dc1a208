"""Per-request sampling of the step's logits: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Each request owns a torch.Generator, so a seeded request draws the same
tokens whatever else shares its batch. Greedy rows are taken in one batched
argmax; only rows that really sample pay for a per-row draw.

Hostile parameters are normalised rather than refused: a temperature under
``GREEDY_TEMPERATURE`` is greedy (as in vLLM: dividing logits by it would
overflow float32 to inf, and softmax of inf is NaN), and top_p always keeps
the most likely token, however small it is (1e-46 is 0 in float32). A row
whose draw still fails carries its error in ``SampledToken.error``: only that
request ends, not the batch around it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from engine.request import SamplingParams


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token, when asked for
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives
    error: str | None = None  # this row's draw failed: its request ends, the token is meaningless


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token (``[rows, vocab]`` on CPU): the first of equal maxima, NaN above all, as
    ``torch.argmax``, whose CPU reduction took more than twice as long as ``max``'s over a vocabulary."""
    return logits.max(dim=-1).indices.tolist()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own random stream; None for greedy decoding, which draws nothing."""
    if is_greedy(params):
        return None  # a Generator costs several microseconds on the request path, for nothing here
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return generator


def filtered_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
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
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
    if params.min_p > 0:  # draw needs no renormalising: it scales its uniform by the total
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from ``probs`` by inverting its cumulative distribution with one uniform.

    torch.multinomial draws one exponential per vocabulary entry to take a single sample, which
    made sampling a large part of a step. The float64 running sum with ``right=True`` can never
    land on a token of probability zero (one a grammar or top-k/top-p removed).
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"probabilities sum to {total}")
    u = torch.rand(1, dtype=torch.float64, generator=generator) * total
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= probs.numel():  # u rounded up to the total: the last token that has any mass
        token = int(torch.nonzero(probs)[-1])
    return token


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ([rows, vocab], float32)."""
    logits = logits.float().cpu()
    token_ids = greedy_tokens(logits)
    errors: dict[int, str] = {}
    for row, p in enumerate(params):
        if not is_greedy(p):
            try:
                token_ids[row] = draw(filtered_probs(logits[row], p), generators[row])
            except Exception as exc:  # e.g. NaN logits: this request's problem, not its batch's
                errors[row] = f"sampling failed: {exc}"

    results = [SampledToken(t, error=errors.get(row)) for row, t in enumerate(token_ids)]
    add_logprobs(results, logits, params)
    return results


def add_logprobs(results: list[SampledToken], logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Fill in the logprobs of each row's token that asks for them, from ``logits`` (float32, on CPU)."""
    wants_logprobs = [row for row, p in enumerate(params) if p.logprobs is not None and results[row].error is None]
    token_ids = [r.token_id for r in results]
    if wants_logprobs:
        logprobs = torch.log_softmax(logits[wants_logprobs], dim=-1)
        for i, row in enumerate(wants_logprobs):
            chosen = token_ids[row]
            results[row].logprob = float(logprobs[i, chosen])
            k = params[row].logprobs or 0
            if k:
                values, ids = torch.topk(logprobs[i], k)
                results[row].top = tuple(zip(ids.tolist(), values.tolist()))
