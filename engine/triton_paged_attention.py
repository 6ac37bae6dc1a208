"""Paged decode attention on CUDA: a Triton kernel that walks each sequence's block table.

One program per (sequence, KV head) handles the query heads sharing that KV
head: it loads the block ids from the table, reads each block's keys and
values where they lie in the pool, and keeps a running max and sum (online
softmax) in float32, so no context is ever gathered into a padded copy.

Tested on CPU under TRITON_INTERPRET=1 against a float64 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# What the kernel reads as "no window": longer than any context.
NO_WINDOW = 2**31 - 1


@triton.jit
def _paged_decode(q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, scale, window, softcap,
                  GROUP, HEAD_DIM, BLOCK_SIZE,
                  stride_qb, stride_qh, stride_cb, stride_ct, stride_ckv, stride_ch, stride_tb, stride_ob,
                  GROUP_P: tl.constexpr, DIM_P: tl.constexpr, BLOCK_P: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    # The window keeps positions [first, ctx): HF's kv_idx > q_idx - window with q_idx = ctx - 1.
    first = tl.maximum(ctx - window, 0)
    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, DIM_P)
    offs_t = tl.arange(0, BLOCK_P)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale

    peak = tl.full((GROUP_P,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((GROUP_P,), dtype=tl.float32)
    acc = tl.zeros((GROUP_P, DIM_P), dtype=tl.float32)
    head_base = cache_ptr + kv_head * stride_ch
    for start in range(first - first % BLOCK_SIZE, ctx, BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE)
        t_mask = (offs_t < BLOCK_SIZE) & (start + offs_t < ctx) & (start + offs_t >= first)
        rows = head_base + block * stride_cb + offs_t[:, None] * stride_ct + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(rows, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(rows + stride_ckv, mask=kv_mask, other=0.0).to(tl.float32)
        # [GROUP_P, BLOCK_P] scores as a broadcast product: the group is too small for tl.dot.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both tails, and tl has no tanh on every release.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, axis=1))
        rescale = tl.exp(peak - new_peak)
        p = tl.exp(scores - new_peak[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        peak = new_peak

    out = acc / total[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """``q`` [B, heads, d] (rows may be strided) -> ``[B, heads * d]``; see engine/attention_kernels.py."""
    batch, num_heads, head_dim = q.shape
    _, block_size, _, kv_heads, _ = kv_cache.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    if not kv_cache.is_contiguous() or kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be contiguous")
    out = q.new_empty(batch, num_heads * head_dim)
    group = num_heads // kv_heads
    window = window if window > 0 else NO_WINDOW
    _paged_decode[(batch, kv_heads)](
        q, kv_cache, block_tables, context_lens, out, scale, window, softcap,
        group, head_dim, block_size,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0),
        GROUP_P=triton.next_power_of_2(group), DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_P=triton.next_power_of_2(block_size), SOFTCAP=softcap > 0,
    )
    return out
