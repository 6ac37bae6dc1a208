"""Prompt logprobs: how likely the model found each prompt token after the tokens before it.

vLLM's ``prompt_logprobs`` and OpenAI's ``echo`` with ``logprobs`` ask for them; evaluation
harnesses score answers this way. The row of prompt position ``p`` predicts prompt token
``p + 1``, so a request's scores arrive with its prefill chunks, whatever their size. Three rules
keep them whole and cheap:

- such a request reads nothing from the prefix cache until it has them all
  (``Sequence.reads_prefix_cache``): a hit would skip the rows they come from, and would tell
  its tenant what the cache holds;
- rows recomputed after a preemption are not scored again (the request keeps what it has);
- the LM head runs over at most ``SLICE_ROWS`` rows at a time, so a long prompt never holds a whole
  ``[prompt, vocab]`` matrix beside a step's other work; where others may be served between the
  slices (express work beside the step), each slice is sized to last about ``SLICE_S`` from the
  time the one before took, so that a request arriving meanwhile, or a stream whose bound nears,
  waits one short slice, on a slow CPU as on a fast one; each slice's scores become its rows'
  logprobs before the next one starts.

Only the first choice of an n > 1 request scores; the gateway gives its scores to every choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.request import TokenLogprob
from engine.request_state import RequestState
from engine.tokenizer import TextTokenizer
from scheduler.plan import ScheduledChunk

SLICE_ROWS = 128  # the panel kernel reads the head once per slice: more rows, fewer passes over it
# Beside the step, a slice is what an arrival or a stream waits for before it is served: about one layer of a
# long chunk, the forward's own interval between such chances. Timed rather than counted, as a scored row costs
# several times more on a slow CPU; the extra passes over the head are paid by the scored request.
SLICE_S = 0.015
FIRST_SLICE_ROWS = 32  # before any slice was timed
MIN_SLICE_ROWS = 8  # bounds the passes over the head where even a few rows take longer than SLICE_S


@dataclass(frozen=True)
class PromptRows:
    """Rows of one request in this step that score its prompt: positions ``[first, first + count)``."""

    state: RequestState
    first: int
    count: int


def rows_to_score(chunks: Sequence[ScheduledChunk],
                  state_of: Callable[[str], RequestState | None]) -> tuple[list[PromptRows], list[int]]:
    """What this step's chunks score, and those rows' indices among the step's tokens (plan order)."""
    wanted: list[PromptRows] = []
    step_rows: list[int] = []
    offset = 0
    for chunk in chunks:
        state = state_of(chunk.seq.seq_id)
        scores = state.prompt_scores if state is not None else None
        if scores is not None:
            # Entry 0 is the first token's, which no row predicts: rows [0, len - 1) are scored.
            first = max(chunk.start, len(scores) - 1)
            end = min(chunk.end, chunk.seq.num_prompt_tokens - 1)
            if first < end:
                wanted.append(PromptRows(state, first, end - first))
                step_rows.extend(range(offset + first - chunk.start, offset + end - chunk.start))
        offset += chunk.num_tokens
    return wanted, step_rows


@torch.inference_mode()
def score_prompts(hidden: torch.Tensor, wanted: Sequence[PromptRows],
                  head_logits: Callable[[torch.Tensor], torch.Tensor], tokenizer: TextTokenizer,
                  between_slices: Callable[[], None] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> None:
    """Append each request's scores for ``wanted`` rows (``hidden``: their final hidden states, in order).

    ``between_slices`` is called before each slice, as the forward calls the step loop between two
    layers: a long prompt's scores are a large part of its step, and a neighbour's short request
    that arrives meanwhile need not wait for all of them. With it, slices are timed by ``clock`` and
    sized to ``SLICE_S``; without it (nobody is served beside the step), they are ``SLICE_ROWS``."""
    # Per row: the request's scores it appends to, the prompt token it scores, and how many alternatives.
    owners = [(w.state.prompt_scores, token_id, w.state.request.params.prompt_logprobs or 0)
              for w in wanted for token_id in w.state.seq.prompt_token_ids[w.first + 1:w.first + 1 + w.count]]
    targets = torch.tensor([token_id for _, token_id, _ in owners], dtype=torch.long, device=hidden.device)
    top_k = max((k for _, _, k in owners), default=0)
    timed = between_slices is not None
    lo, rows = 0, FIRST_SLICE_ROWS if timed else SLICE_ROWS
    while lo < len(owners):
        if timed:
            between_slices()
            started = clock()
        hi = min(len(owners), lo + rows)
        logprobs = torch.log_softmax(head_logits(hidden[lo:hi]), dim=-1)
        picked = logprobs.gather(1, targets[lo:hi, None])
        chosen = picked.squeeze(1).tolist()
        ranks = ((logprobs > picked).sum(dim=1, dtype=torch.int32) + 1).tolist()
        top = torch.topk(logprobs, top_k) if top_k else None
        top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
        for i, (scores, token_id, k) in enumerate(owners[lo:hi]):
            alternatives = tuple((tid, tokenizer.id_to_token_text(tid), lp)
                                 for tid, lp in zip(top_ids[i][:k], top_values[i][:k])) if k else ()
            scores.append(TokenLogprob(token_id, tokenizer.id_to_token_text(token_id), chosen[i], alternatives,
                                       ranks[i]))
        if timed:
            rows = _next_slice_rows(hi - lo, clock() - started)
        lo = hi
    for w in wanted:
        if len(w.state.prompt_scores) == w.state.seq.num_prompt_tokens:
            w.state.seq.reads_prefix_cache = True


def _next_slice_rows(rows: int, took_s: float) -> int:
    """Rows of the next slice beside the step, from the last one's: as many as fit ``SLICE_S`` at its pace."""
    if took_s <= 0:
        return SLICE_ROWS
    return max(MIN_SLICE_ROWS, min(SLICE_ROWS, round(rows * SLICE_S / took_s)))
