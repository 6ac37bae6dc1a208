"""Random paged decode cases and their float64 attention, shared by the CPU kernel test and the
Triton interpreter check (which imports it from a subprocess)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, heads, d], rows strided like the engine's view into fused qkv
    kv_cache: torch.Tensor  # [blocks, block_size, 2, kv_heads, d]
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [B]
    window: int = 0  # a sliding window; 0: none
    softcap: float = 0.0  # scores through softcap * tanh(score / softcap); 0: none

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def random_case(context_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype = torch.float32, seed: int = 0, window: int = 0, softcap: float = 0.0) -> DecodeCase:
    """Blocks handed out shuffled, so a sequence's context is scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n] + [0] * (max(needed) - n))
        used += n
    kv_cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=g).to(dtype)
    # q as a column slice of a wider row, as the engine passes it.
    wide = torch.randn(len(context_lens), heads * head_dim + 2 * kv_heads * head_dim, generator=g).to(dtype)
    q = wide[:, : heads * head_dim].view(len(context_lens), heads, head_dim)
    return DecodeCase(q, kv_cache, torch.tensor(tables), torch.tensor(context_lens), window, softcap)


def reference(case: DecodeCase) -> torch.Tensor:
    """Float64 attention of each row over its context, read position by position: ``[B, heads * d]``."""
    batch, heads, head_dim = case.q.shape
    block_size, kv_heads = case.kv_cache.shape[1], case.kv_cache.shape[3]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(case.context_lens[b])
        first = max(0, n - case.window) if case.window else 0
        slots = [int(case.block_tables[b, p // block_size]) * block_size + p % block_size for p in range(first, n)]
        context = case.kv_cache.reshape(-1, 2, kv_heads, head_dim)[slots].double()
        keys = context[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        values = context[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", case.q[b].double(), keys) * case.scale
        if case.softcap:
            scores = torch.tanh(scores / case.softcap) * case.softcap
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out.reshape(batch, heads * head_dim)


# name -> (context lengths, heads, kv_heads, head_dim, block_size)
CASES = {
    # SmolLM2's shape: 9 query heads on 3 KV heads, head_dim 64; lengths on, across and off block edges.
    "smollm2_gqa": ([1, 16, 17, 40, 250, 5], 9, 3, 64, 16),
    "mha": ([3, 8, 9], 4, 4, 16, 4),
    "one_kv_head": ([7, 12], 4, 1, 32, 4),
    "odd_block_size": ([1, 5, 11, 23], 6, 2, 16, 5),
    "single_sequence": ([33], 9, 3, 64, 16),
}

# name -> (case of CASES, sliding window, soft-cap): windows inside one block, across blocks, longer
# than some contexts; soft-caps alone and with a window.
VARIANTS = {
    "window_across_blocks": ("smollm2_gqa", 20, 0.0),
    "window_inside_a_block": ("odd_block_size", 3, 0.0),
    "softcap": ("mha", 0, 1.5),
    "window_and_softcap": ("odd_block_size", 7, 2.0),
}


def variant_case(name: str, dtype: torch.dtype = torch.float32) -> DecodeCase:
    case, window, softcap = VARIANTS[name]
    lens, heads, kv_heads, head_dim, block_size = CASES[case]
    return random_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(name), window=window, softcap=softcap)
