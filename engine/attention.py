"""Attention over the paged KV cache for one step of mixed prefill chunks and decodes.

Everything that depends only on the plan (slots, padded block tables, masks)
is built once per step in :class:`AttentionMetadata`; the per-layer call does
tensor work only, which matters with 30 layers and ~10 µs per eager op.

Decode rows (chunks of one token) go to the in-place paged kernel of
engine/attention_kernels.py when the runner has one; otherwise (the fallback)
they share one batched SDPA call over their contexts gathered from the cache
into ``[B, max_ctx]`` with a length mask. With the kernel, a chunk of a few tokens
(``DECODE_ROWS_PER_CHUNK``: drafts to verify, a short prompt) is that many decode rows.
Each longer chunk gets its own attention: causal over its own keys when it starts
at position 0, otherwise over the cached context plus itself with an offset causal
mask (later chunks of a chunked prefill, prefix-cache hits, recompute). The runner's
prefill kernel does both when it has one (the context gathered from the cache first);
SDPA does them otherwise.

Layers with a sliding window read ``AttentionMetadata.windowed``, the same step's
metadata with masks that also drop keys more than ``window - 1`` positions back
(HF's ``kv_idx > q_idx - sliding_window``); the decode kernels take the window
and the soft-cap as arguments. Layers with attention logit soft-capping, which
SDPA cannot do, run their prefills and gathered decodes eagerly (``_attend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention_kernels import DecodeKernel, PrefillKernel
from engine.kv_quant import dequantize_q8_0, is_q8_0, read_slots, write_slots


# Chunks of up to this many tokens attend as decode rows where a paged kernel serves them (``_build``): the
# verification of speculative drafts (k + 1 positions) is one.
DECODE_ROWS_PER_CHUNK = 8


@dataclass(frozen=True)
class LayerAttention:
    """What a layer's attention needs beyond q, k and v: its model's family decides."""

    scale: float
    window: int | None = None
    softcap: float | None = None


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
    # The chunk starts at position 0, so its own keys are all it attends to (with a
    # window, SDPA still needs context_slots and mask; the prefill kernel does not).
    # A windowed chunk's context_slots start at its first query's window, not at 0.
    starts_at_zero: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each row's new K/V is written
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    num_tokens: int
    # The metadata of the layers with a sliding window, when the model has them.
    windowed: AttentionMetadata | None = None
    # Causal attention for chunks that start at 0 (engine/attention_kernels.py); None: SDPA.
    prefill_kernel: PrefillKernel | None = None

    @property
    def decode_only(self) -> bool:
        """Every row attends as a decode row (no chunk takes the prefill path): rope_decode_attention may serve it."""
        return self.decode is not None and not self.prefills

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
        sliding_window: int | None = None,
        prefill_kernel: PrefillKernel | None = None,
    ) -> AttentionMetadata:
        """``chunks`` is ``(start, num_tokens, block_table)`` per chunk in row order; decode
        rows run on ``decode_kernel`` when given, else over gathered contexts, and chunks that
        start at 0 on ``prefill_kernel`` when given. With ``sliding_window``, ``windowed``
        holds the masks of the windowed layers."""
        meta = cls._build(chunks, block_size, device, decode_kernel, None)
        meta.prefill_kernel = prefill_kernel
        if sliding_window is not None:
            meta.windowed = cls._build(chunks, block_size, device, decode_kernel, sliding_window)
            meta.windowed.prefill_kernel = prefill_kernel
        return meta

    @classmethod
    def _build(
        cls,
        chunks: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device | str,
        decode_kernel: DecodeKernel | None,
        window: int | None,
    ) -> AttentionMetadata:
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        row = 0
        for start, n, table in chunks:
            end = start + n
            # A chunk of a few tokens (a row's drafts to verify, a short prompt or its last piece) attends as that
            # many decode rows, query p over positions [0, p]: the causal attention it needs, with the context read
            # in place by the paged kernel where the prefill path would gather it first.
            if n == 1 or (decode_kernel is not None and n <= DECODE_ROWS_PER_CHUNK):
                for p in range(start, end):
                    slots.append(table[p // block_size] * block_size + p % block_size)
                    decode_rows.append(row + p - start)
                    decode_lens.append(p + 1)
                    decode_tables.append(table[: (p + block_size) // block_size])
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
            if (len(decode_rows) > 1 or window is not None) and decode_kernel is None:
                key_pos, lens = torch.arange(max_blocks * block_size, device=device)[None, :], as_tensor(decode_lens)[:, None]
                mask = key_pos < lens
                if window is not None:
                    mask &= key_pos >= lens - window
                mask = mask[:, None, None, :]
            first = decode_rows[0]
            contiguous = decode_rows[-1] - first == len(decode_rows) - 1
            rows = slice(first, first + len(decode_rows)) if contiguous else as_tensor(decode_rows)
            decode = DecodeBatch(rows=rows, block_tables=as_tensor(padded), context_lens=as_tensor(decode_lens),
                                 mask=mask, context_len=max(decode_lens), kernel=decode_kernel)

        prefills = []
        for row0, start, end, table in prefill_specs:
            rows = slice(row0, row0 + end - start)
            if start == 0 and (window is None or end <= window):
                prefills.append(PrefillChunk(rows=rows, context_slots=None, mask=None, starts_at_zero=True))
                continue
            # A window lets the chunk skip the keys before its first query's window.
            first = 0 if window is None else max(0, start - window + 1)
            q_pos = torch.arange(start, end, device=device)[:, None]
            key_pos = torch.arange(first, end, device=device)[None, :]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
            context = [table[p // block_size] * block_size + p % block_size for p in range(first, end)]
            prefills.append(PrefillChunk(rows=rows, context_slots=as_tensor(context), mask=mask, starts_at_zero=start == 0))
        return cls(slot_mapping=as_tensor(slots), decode=decode, prefills=prefills, num_tokens=row)


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
) -> torch.Tensor:
    """Write this step's keys and values into the cache, then attend with ``q``.

    ``q`` is [T, heads, d], ``kv`` [T, 2, kv_heads, d] and ``kv_cache`` one
    layer of :class:`KVCache` (float, or Q8_0 bytes: engine/kv_quant.py). Returns ``[T, heads * d]``.
    A chunk that starts at 0 attends to its own keys as computed; later ones read them back from the pool.
    """
    if layer.window is not None:
        meta = meta.windowed
    num_tokens, num_heads, head_dim = q.shape
    scale, softcap = layer.scale, layer.softcap
    write_slots(kv_cache, meta.slot_mapping, kv)
    # Common steps (all decodes, or one prefill) return their group's output as is.
    out = None if meta.single_group else q.new_empty(num_tokens, num_heads * head_dim)

    if meta.decode is not None:
        d = meta.decode
        if d.kernel is not None:
            o = d.kernel(q[d.rows], kv_cache, d.block_tables, d.context_lens, scale, layer.window or 0, softcap or 0.0)
        else:
            o = _gathered_decode(q[d.rows], kv_cache, d, scale, softcap)
        if out is None:
            return o
        out[d.rows] = o
    for p in meta.prefills:
        if meta.prefill_kernel is not None and softcap is None:
            if p.starts_at_zero:
                o = meta.prefill_kernel(q[p.rows], kv[p.rows, 0], kv[p.rows, 1], scale, layer.window or 0, 0)
            else:
                context = read_slots(kv_cache, p.context_slots, q.dtype)
                offset = context.shape[0] - (p.rows.stop - p.rows.start)
                o = meta.prefill_kernel(q[p.rows], context[:, 0], context[:, 1], scale, layer.window or 0, offset)
            if out is None:
                return o
            out[p.rows] = o
            continue
        # 4-D [1, heads, n, d] inputs: what the fused CUDA kernels expect.
        qp = q[p.rows].transpose(0, 1).unsqueeze(0)
        if p.context_slots is None:
            k, v = kv[p.rows, 0].transpose(0, 1), kv[p.rows, 1].transpose(0, 1)
            o = _attend(qp, k[None], v[None], None, scale, softcap, causal=True)
        else:
            context = read_slots(kv_cache, p.context_slots, q.dtype)
            k, v = context[:, 0].transpose(0, 1), context[:, 1].transpose(0, 1)
            o = _attend(qp, k[None], v[None], p.mask, scale, softcap)
        o = o[0].transpose(0, 1).reshape(-1, num_heads * head_dim)
        if out is None:
            return o
        out[p.rows] = o
    return out


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                          meta: AttentionMetadata, layer: LayerAttention, num_heads: int) -> torch.Tensor:
    """``paged_attention`` for a step of decodes only on the CPU kernel, from the fused q|k|v projection
    ``[T, (heads + 2 * kv_heads) * d]`` before RoPE: the rotation (all of each head, tables from
    engine/rope.py), the KV write and the attention in one call (csrc/paged_attention.cpp). Returns
    ``[T, heads * d]``; rotates ``qkv``'s query and key heads in place, as the unfused path does."""
    if layer.window is not None:
        meta = meta.windowed
    d = meta.decode
    return torch.ops.tiergate.rope_decode_attention(qkv, cos, sin, kv_cache, meta.slot_mapping, d.block_tables,
                                                    d.context_lens, num_heads, layer.scale, layer.window or 0,
                                                    layer.softcap or 0.0)


def _gathered_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeBatch, scale: float, softcap: float | None
) -> torch.Tensor:
    """The fallback: each context copied out of the pool into ``[B, max_ctx]``, then one SDPA."""
    batch, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    # index_select over flattened block ids copies whole blocks; advanced indexing
    # with the 2-D table was 1.5x slower.
    context = kv_cache.index_select(0, d.block_tables.flatten())
    if is_q8_0(kv_cache):
        context = dequantize_q8_0(context, q.dtype)
    context = context.view(batch, -1, 2, kv_heads, head_dim)
    if d.mask is None:
        context = context[:, : d.context_len]
    k, v = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
    # The query heads sharing a KV head go in as that head's queries: no K/V expansion for GQA.
    qd = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    # reshape, not view: fused CUDA kernels may return a transposed layout.
    return _attend(qd, k, v, d.mask, scale, softcap).reshape(batch, num_heads * head_dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA over ``q`` [..., heads, n, d] and ``k``, ``v`` [..., kv_heads, m, d]; with ``softcap``,
    the same eagerly with the scores passed through ``tanh(s / cap) * cap`` before the mask."""
    *lead, heads, n, d = q.shape
    kv_heads, m = k.shape[-3], k.shape[-2]
    if softcap is None:
        # enable_gqa only where it is needed: it narrows the backends SDPA may pick on CUDA.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=heads != kv_heads)
    # Each KV head's query heads as one group dimension, so K and V are never repeated.
    qg = q.reshape(*lead, kv_heads, heads // kv_heads, n, d)
    scores = qg @ k.unsqueeze(-3).transpose(-1, -2) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask is not None:
        scores = scores.masked_fill(~(mask.unsqueeze(-3) if mask.dim() == q.dim() else mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(-3)).reshape(q.shape)
