"""Attention over the paged KV cache for one step of mixed prefill chunks and decodes.

Everything that depends only on the plan (slots, padded block tables, masks)
is built once per step in :class:`AttentionMetadata`; the per-layer call does
tensor work only, which matters with 30 layers and ~10 µs per eager op.

Decode rows (chunks of one token) go to the in-place paged kernel of
engine/paged_attention.py when the runner has one; otherwise (the fallback)
they share one batched SDPA call over their contexts gathered from the cache
into ``[B, max_ctx]`` with a length mask.
Each longer chunk gets its own SDPA: causal over its own keys when it starts at
position 0, otherwise over the cached context plus itself with an offset
causal mask (later chunks of a chunked prefill, prefix-cache hits, recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.paged_attention import DecodeKernel


@dataclass
class DecodeBatch:
    rows: slice | torch.Tensor  # rows of the step holding the decode tokens
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [B]
    # For the gathered path, the [B, max_ctx] keys to attend: a [B, 1, 1, max_ctx] bool
    # mask, or, for a single sequence, its context length (slicing is free; a mask costs
    # SDPA time). The kernel reads context_lens instead and needs no mask.
    mask: torch.Tensor | None
    context_len: int
    kernel: DecodeKernel | None = None


@dataclass
class PrefillChunk:
    rows: slice
    # Slots of positions [0, end) and the offset causal mask [n, end]; None when
    # the chunk starts at 0 and attends only to its own keys.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each row's new K/V is written
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    num_tokens: int

    @property
    def single_group(self) -> bool:
        """All rows belong to the decode batch or to one prefill chunk: its output is the step's."""
        if self.decode is None:
            return len(self.prefills) == 1
        rows = self.decode.rows
        return not self.prefills and isinstance(rows, slice) and rows.stop - rows.start == self.num_tokens

    @classmethod
    def build(
        cls,
        chunks: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device | str,
        decode_kernel: DecodeKernel | None = None,
    ) -> AttentionMetadata:
        """``chunks`` is ``(start, num_tokens, block_table)`` per chunk in row order; decode
        rows run on ``decode_kernel`` when given, else over gathered contexts."""
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        row = 0
        for start, n, table in chunks:
            end = start + n
            if n == 1:
                slots.append(table[start // block_size] * block_size + start % block_size)
                decode_rows.append(row)
                decode_lens.append(end)
                decode_tables.append(table[: (end + block_size - 1) // block_size])
            else:
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
                prefill_specs.append((row, start, end, table))
            row += n
        as_tensor = lambda data: torch.tensor(data, dtype=torch.long, device=device)  # noqa: E731

        decode = None
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            mask = None
            if len(decode_rows) > 1 and decode_kernel is None:
                mask = torch.arange(max_blocks * block_size, device=device)[None, :] < as_tensor(decode_lens)[:, None]
                mask = mask[:, None, None, :]
            first = decode_rows[0]
            contiguous = decode_rows[-1] - first == len(decode_rows) - 1
            rows = slice(first, first + len(decode_rows)) if contiguous else as_tensor(decode_rows)
            decode = DecodeBatch(rows=rows, block_tables=as_tensor(padded), context_lens=as_tensor(decode_lens),
                                 mask=mask, context_len=max(decode_lens), kernel=decode_kernel)

        prefills = []
        for row0, start, end, table in prefill_specs:
            rows = slice(row0, row0 + end - start)
            if start == 0:
                prefills.append(PrefillChunk(rows=rows, context_slots=None, mask=None))
                continue
            context = [table[p // block_size] * block_size + p % block_size for p in range(end)]
            q_pos = torch.arange(start, end, device=device)[:, None]
            mask = torch.arange(end, device=device)[None, :] <= q_pos
            prefills.append(PrefillChunk(rows=rows, context_slots=as_tensor(context), mask=mask))
        return cls(slot_mapping=as_tensor(slots), decode=decode, prefills=prefills, num_tokens=row)


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write this step's keys and values into the cache, then attend with ``q``.

    ``q`` is [T, heads, d], ``kv`` [T, 2, kv_heads, d] and ``kv_cache`` one
    layer of :class:`KVCache`. Returns ``[T, heads * d]``.
    """
    num_tokens, num_heads, head_dim = q.shape
    slots = kv_cache.view(-1, *kv_cache.shape[2:])
    slots.index_copy_(0, meta.slot_mapping, kv)
    # Common steps (all decodes, or one prefill) return their group's output as is.
    out = None if meta.single_group else q.new_empty(num_tokens, num_heads * head_dim)

    if meta.decode is not None:
        d = meta.decode
        if d.kernel is not None:
            o = d.kernel(q[d.rows], kv_cache, d.block_tables, d.context_lens, head_dim**-0.5)
        else:
            o = _gathered_decode(q[d.rows], kv_cache, d)
        if out is None:
            return o
        out[d.rows] = o
    for p in meta.prefills:
        # 4-D [1, heads, n, d] inputs: what the fused CUDA kernels expect.
        qp = q[p.rows].transpose(0, 1).unsqueeze(0)
        if p.context_slots is None:
            k, v = kv[p.rows, 0].transpose(0, 1), kv[p.rows, 1].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, k[None], v[None], is_causal=True, enable_gqa=True)
        else:
            context = slots.index_select(0, p.context_slots)
            k, v = context[:, 0].transpose(0, 1), context[:, 1].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, k[None], v[None], attn_mask=p.mask, enable_gqa=True)
        o = o[0].transpose(0, 1).reshape(-1, num_heads * head_dim)
        if out is None:
            return o
        out[p.rows] = o
    return out


def _gathered_decode(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
    """The fallback: each context copied out of the pool into ``[B, max_ctx]``, then one SDPA."""
    batch, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    # index_select over flattened block ids copies whole blocks; advanced indexing
    # with the 2-D table was 1.5x slower.
    context = kv_cache.index_select(0, d.block_tables.flatten()).view(batch, -1, 2, kv_heads, head_dim)
    if d.mask is None:
        context = context[:, : d.context_len]
    k, v = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
    # The query heads sharing a KV head go in as that head's queries: no K/V expansion for GQA.
    qd = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    # reshape, not view: fused CUDA kernels may return a transposed layout.
    return F.scaled_dot_product_attention(qd, k, v, attn_mask=d.mask).reshape(batch, num_heads * head_dim)
