"""Draft-model drafting for speculative decoding: a small checkpoint with the base model's tokenizer
proposes each drafting row's next tokens, served in this process over a paged KV pool of its own.

Per step, the rows that draft run ``k`` decode steps of the draft model, batched over those rows:
the first computes whatever of each row's tokens its draft KV lacks (the whole context when the row
first drafts, the newest token and, after a step that accepted every draft, the last draft too) and
the later ones one token each. Greedy rows take the draft's argmax (masked by the row's grammar);
sampled rows draw from the draft's own filtered distribution ``q``, kept for the rejection sampler
(engine/spec_sampling.py), with stop tokens removed from ``q`` so that no draft is cut after it was
drawn (a cut that depends on the drawn token would bias the output).

The draft KV is its own tensors and its own block table per row (``DraftKV``), never the base pool's
blocks; after verification a row keeps exactly its accepted tokens there (``keep``), and a row that
ends or is preempted gives its blocks back (``release``). The draft runs without LoRA: an adapter
row's drafts come from the draft model alone and are verified by the base model with the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from engine.attention import AttentionMetadata
from engine.grammar import GrammarMatcher, mask_logits
from engine.loader import LoadedModel
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.sampler import draw, filtered_probs, greedy_tokens, is_greedy


def check_same_vocabulary(base: Tokenizer, draft: Tokenizer) -> None:
    """ValueError unless the draft model's tokenizer maps every token to the base model's id: its token
    ids are what the base model verifies."""
    base_vocab, draft_vocab = base.get_vocab(with_added_tokens=True), draft.get_vocab(with_added_tokens=True)
    if base_vocab != draft_vocab:
        differ = len(set(base_vocab.items()) ^ set(draft_vocab.items()))
        raise ValueError(f"the draft model's vocabulary differs from the base model's ({len(draft_vocab)} tokens "
                         f"against {len(base_vocab)}, {differ} entries differ): a draft model needs the same tokenizer")


@dataclass
class DraftRequest:
    """One row that drafts this step."""

    seq_id: str
    token_ids: list[int]  # the row's tokens, prompt then output, the newest last
    limit: int  # the most tokens to draft
    params: SamplingParams
    generator: torch.Generator | None
    stop_token_ids: frozenset[int]
    grammar: GrammarMatcher | None = None  # greedy rows only (see Speculator.draft)


@dataclass
class DraftProposal:
    tokens: list[int]
    # Sampled rows: [len(tokens), vocab], the distribution each draft was drawn from; None for greedy rows.
    probs: torch.Tensor | None = None


@dataclass
class _Row:
    block_table: list[int] = field(default_factory=list)
    computed: int = 0  # positions [0, computed) of the row's tokens are in the draft KV


class DraftKV:
    """Block accounting of the draft model's KV pool: a free list and one block table per row."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.rows: dict[str, _Row] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def row(self, seq_id: str) -> _Row:
        return self.rows.setdefault(seq_id, _Row())

    def reserve(self, row: _Row, num_tokens: int) -> bool:
        """Blocks for positions ``[0, num_tokens)``; False (nothing taken) if the pool has too few free."""
        need = -(-num_tokens // self.block_size) - len(row.block_table)
        if need > len(self._free):
            return False
        for _ in range(need):
            row.block_table.append(self._free.pop())
        return True

    def keep(self, seq_id: str, num_tokens: int) -> None:
        """The row's KV holds at most positions ``[0, num_tokens)``; blocks past them go back."""
        row = self.rows.get(seq_id)
        if row is None:
            return
        row.computed = min(row.computed, num_tokens)
        keep = -(-row.computed // self.block_size)
        self._free.extend(reversed(row.block_table[keep:]))
        del row.block_table[keep:]

    def release(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free.extend(reversed(row.block_table))


class DraftModel:
    """The draft model, its KV pool, and the drafting of a batch of rows."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, vocab_size: int,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """``vocab_size``: the base model's logits width, which the draft's logits are cut or padded to."""
        self.runner = ModelRunner(loaded, num_blocks, block_size, device, dtype)
        self.kv = DraftKV(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.max_positions = loaded.model_config.max_position_embeddings

    def propose(self, requests: list[DraftRequest]) -> dict[str, DraftProposal]:
        """Each request's drafts (fewer than its limit where the draft stops early, none where the draft
        pool has no room for it or the row is longer than the draft model's context)."""
        proposals = {r.seq_id: DraftProposal([]) for r in requests}
        drawn_from: dict[str, list[torch.Tensor]] = {r.seq_id: [] for r in requests}  # sampled rows' q
        active = []  # (request, row, start position, tokens to compute)
        for r in requests:
            row = self.kv.row(r.seq_id)
            row.computed = min(row.computed, len(r.token_ids) - 1)
            end = len(r.token_ids) + r.limit - 1
            if end <= self.max_positions and self.kv.reserve(row, end):
                active.append((r, row, row.computed, r.token_ids[row.computed:]))
        walked = {r.seq_id: 0 for r in requests}
        try:
            while active:
                logits = self._forward([(start, tokens, row.block_table) for _, row, start, tokens in active])
                following = []
                for i, (r, row, start, tokens) in enumerate(active):
                    row.computed = start + len(tokens)
                    token = self._choose(logits[i], r, proposals[r.seq_id], drawn_from[r.seq_id], walked)
                    if token is not None and len(proposals[r.seq_id].tokens) < r.limit:
                        following.append((r, row, row.computed, [token]))
                active = following
        finally:
            for r in requests:
                if r.grammar is not None:
                    r.grammar.rollback(walked[r.seq_id])
        for seq_id, probs in drawn_from.items():
            if probs:
                proposals[seq_id].probs = torch.stack(probs)
        return proposals

    def keep(self, seq_id: str, num_tokens: int) -> None:
        """After verification: the row's draft KV holds its first ``num_tokens`` tokens at most."""
        self.kv.keep(seq_id, num_tokens)

    def release(self, seq_id: str) -> None:
        """The row ended or was preempted: its draft KV blocks go back."""
        self.kv.release(seq_id)

    def _choose(self, logits: torch.Tensor, r: DraftRequest, proposal: DraftProposal, drawn_from: list[torch.Tensor],
                walked: dict[str, int]) -> int | None:
        """The row's next draft from the draft's logits at its last position, appended to ``proposal``
        (a sampled row's ``q`` to ``drawn_from``); None where the row stops drafting."""
        if is_greedy(r.params):
            if r.grammar is not None:
                mask_logits(logits.unsqueeze(0), [r.grammar])
            token = greedy_tokens(logits.unsqueeze(0))[0]
            if token in r.stop_token_ids:
                return None
            if r.grammar is not None:
                if not r.grammar.accept(token):
                    return None
                walked[r.seq_id] += 1
                if r.grammar.is_terminated:  # nothing may be sampled after it: not a draft
                    return None
            proposal.tokens.append(token)
            return token
        probs = filtered_probs(logits, r.params)
        stops = [t for t in r.stop_token_ids if t < probs.numel()]
        if stops:
            probs[stops] = 0.0
        total = float(probs.sum(dtype=torch.float64))
        if not total > 0.0:
            return None
        token = draw(probs, r.generator)
        proposal.tokens.append(token)
        drawn_from.append(probs / total)
        return token

    @torch.inference_mode()
    def _forward(self, chunks: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
        """Float32 logits ``[chunks, vocab_size]`` at the last position of each ``(start, tokens,
        block_table)`` chunk, whose KV it writes."""
        runner = self.runner
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for start, tokens, _ in chunks:
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            last_rows.append(len(token_ids) - 1)
        specs = [(start, len(tokens), table) for start, tokens, table in chunks]
        meta = AttentionMetadata.build(specs, runner.block_size, runner.device, runner.decode_kernel,
                                       runner.config.sliding_window, runner.prefill_kernel)
        as_tensor = lambda data: torch.tensor(data, dtype=torch.long, device=runner.device)  # noqa: E731
        hidden = runner.model.final_hidden(as_tensor(token_ids), as_tensor(positions), meta, runner.kv_cache,
                                           as_tensor(last_rows))
        logits = runner.model.head_logits(hidden).float().cpu()
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, :self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits
