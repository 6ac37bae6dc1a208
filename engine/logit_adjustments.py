"""Each request's own changes to its row of a step's logits before sampling: logit_bias and the
presence, frequency and repetition penalties.

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
                or params.repetition_penalty != 1.0)


@torch.inference_mode()  # the runner's logits are inference tensors
def adjust_logits_(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                   outputs: Sequence[Sequence[int]]) -> None:
    """Apply each row's adjustments to ``logits`` ([rows, vocab], float32) in place.

    ``prompts`` and ``outputs``: each row's prompt and generated token ids so far.
    """
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        if not adjusts_logits(p):
            continue
        row_logits = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor([*prompts[row], *outputs[row]], dtype=torch.long, device=logits.device)] = True
            scores = row_logits[seen]
            row_logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and outputs[row]:
            counts = torch.bincount(torch.tensor(outputs[row], dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=logits.device, dtype=logits.dtype)
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor([token for token, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            biases = torch.tensor([bias for _, bias in p.logit_bias], dtype=logits.dtype, device=logits.device)
            row_logits.index_add_(0, ids, biases)  # adds up a token named twice ("7" and "07")
