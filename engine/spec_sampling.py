"""Verifying one row's drafted tokens against the model: which drafts it keeps, and the token after them.

The row's logits hold one position per draft plus one: position ``i`` is the model's distribution
after the row's tokens and drafts ``[0, i)``. Greedy rows keep the drafts that are each position's
argmax, so their output is exactly what decoding one token at a time gives. Sampled rows use
rejection sampling (Leviathan et al. 2023, Chen et al. 2023): a draft proposed with distribution
``q`` is kept with probability ``min(1, p/q)``; on rejection the token is drawn from the residual
``max(0, p - q)`` renormalised. Prompt lookup proposes each draft with certainty (``q`` a point
mass), so a draft is kept with probability ``p(draft)`` and a rejection draws from ``p`` with that
token removed; a draft model (engine/draft_model.py) hands over the ``q`` each draft was drawn from. Either way every output token has exactly the distribution plain sampling gives
(``p`` after the row's temperature, top-k, top-p and min-p, as engine/sampler.py computes it).
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams
from engine.sampler import SampledToken, add_logprobs, draw, filtered_probs, greedy_tokens, is_greedy


def verify_row(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
               generator: torch.Generator | None, draft_probs: torch.Tensor | None = None,
               best: list[int] | None = None) -> list[SampledToken]:
    """The row's accepted drafts then one sampled token, from ``logits`` ([len(drafts) + 1, vocab],
    float32 on CPU, already adjusted and masked position by position); a failed draw is one token
    carrying its error. ``draft_probs``: [len(drafts), vocab], the distribution each draft was drawn
    from; None for drafts proposed with certainty (prompt lookup, or greedy drafting). ``best``: each
    position's argmax, where the caller took them for the whole step at once (a greedy row needs
    nothing else)."""
    try:
        if is_greedy(params):
            tokens = _greedy(greedy_tokens(logits) if best is None else best, drafts)
        elif draft_probs is None:
            tokens = _rejection(logits, drafts, params, generator)
        else:
            tokens = _rejection_of_drawn(logits, drafts, draft_probs, params, generator)
    except Exception as exc:  # e.g. NaN logits: this request's problem, not its batch's
        return [SampledToken(0, error=f"sampling failed: {exc}")]
    results = [SampledToken(t) for t in tokens]
    if params.logprobs is not None:
        add_logprobs(results, logits[:len(tokens)], [params] * len(tokens))
    return results


def _greedy(best: list[int], drafts: list[int]) -> list[int]:
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return drafts[:kept] + [best[kept]]


def _rejection(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
               generator: torch.Generator | None) -> list[int]:
    for i, draft in enumerate(drafts):
        probs = filtered_probs(logits[i], params)
        total = float(probs.sum(dtype=torch.float64))
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        if u * total < float(probs[draft]):
            continue
        probs[draft] = 0.0  # the residual of a point-mass proposal
        return drafts[:i] + [draw(probs, generator)]
    return drafts + [draw(filtered_probs(logits[len(drafts)], params), generator)]


def _rejection_of_drawn(logits: torch.Tensor, drafts: list[int], q: torch.Tensor, params: SamplingParams,
                        generator: torch.Generator | None) -> list[int]:
    """Drafts drawn from ``q``: each kept with probability ``min(1, p/q)``; the first rejected one is
    replaced by a draw from ``max(0, p - q)``."""
    for i, draft in enumerate(drafts):
        probs = filtered_probs(logits[i], params).double()
        p = probs / probs.sum()
        qi = q[i].double()
        qi = qi / qi.sum()
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        if u * float(qi[draft]) < float(p[draft]):
            continue
        residual = (p - qi).clamp_(min=0.0)
        # Rejection implies p(draft) < q(draft), so the residual has mass; rounding aside.
        return drafts[:i] + [draw(residual if float(residual.sum()) > 0.0 else p, generator)]
    return drafts + [draw(filtered_probs(logits[len(drafts)], params), generator)]
