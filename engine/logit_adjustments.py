"""Each request's own changes to its row of a step's logits before sampling: logit_bias, the
presence, frequency and repetition penalties, and min_tokens' ban on its stop tokens.

Only the rows that ask pay: a row with none of them is not touched. The grammar mask comes after
(engine/grammar.py), so no bias or penalty can bring back a token the grammar forbids; the
logprobs a request gets back are those of the adjusted logits, the distribution it was sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import SamplingParams


def adjusts_logits(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or params.min_tokens)


@torch.inference_mode()  # the runner's logits are inference tensors
def adjust_logits_(logits: torch.Tensor, params: Sequence[SamplingParams],
                   prompts: Sequence[torch.Tensor | None], outputs: Sequence[Sequence[int]],
                   eos_token_ids: Sequence[int] = ()) -> None:
    """Apply each row's adjustments to ``logits`` ([rows, vocab], float32) in place.

    ``prompts``: each row's prompt token ids as a tensor (int64; read only for a repetition
    penalty, so None for the other rows); ``outputs``: each row's generated token ids so far;
    ``eos_token_ids``: the model's, which a row short of its ``min_tokens`` may not sample.
    """
    device = logits.device
    for row, p in enumerate(params):
        if not adjusts_logits(p):
            continue
        row_logits = logits[row]
        # Each adjustment gathers and scatters the tokens it concerns only: a full-vocabulary pass per
        # row would let one tenant's penalised requests slow every step they share.
        if p.repetition_penalty != 1.0:
            seen = torch.cat((prompts[row], torch.tensor(outputs[row], dtype=torch.long))).to(device)
            scores = row_logits[seen]  # a token seen twice is written twice with the same value
            row_logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and outputs[row]:
            tokens, counts = torch.unique(torch.tensor(outputs[row], dtype=torch.long), return_counts=True)
            penalty = p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
            row_logits.index_add_(0, tokens.to(device), -penalty.to(device))
        if len(outputs[row]) < p.min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            if banned:
                row_logits[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([token for token, _ in p.logit_bias], dtype=torch.long, device=device)
            biases = torch.tensor([bias for _, bias in p.logit_bias], dtype=logits.dtype, device=device)
            row_logits.index_add_(0, ids, biases)  # adds up a token named twice ("7" and "07")
