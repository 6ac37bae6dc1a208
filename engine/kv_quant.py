"""The 8-bit KV cache (``--kv-cache-dtype q8_0``): its byte format, and writing and reading slots in it.

A head's keys (or values) of one token are stored as llama.cpp's Q8_0 blocks: for each 32
dimensions, a float16 scale ``d = max|x| / 127`` and 32 int8 ``round(x / d)``, 34 bytes, so a
head of 64 takes 68 bytes where float32 takes 256. A quantized pool is a uint8 tensor
``[blocks, block_size, 2, kv_heads, head_dim // 32 * 34]``; its dtype is how the attention code
tells it from a float pool. The decode kernel (csrc/paged_attention.cpp, ``kv_heads.h``) reads the
blocks in place and writes them for fused decode steps, bit for bit as ``quantize_q8_0`` here;
everything else (prefill chunks, the gathered fallback) writes with ``quantize_q8_0`` and reads
whole slots back to float with ``dequantize_q8_0``. Written with torch ops: no library op stores
this format, and these paths run once per layer and chunk, not per token.
"""

from __future__ import annotations

import torch

Q8_0_GROUP = 32  # dimensions under one scale
Q8_0_BYTES = 2 + Q8_0_GROUP  # float16 scale, then the int8 values

# What a pool stores: the model's dtype, or the name of an 8-bit format.
KVDtype = torch.dtype | str


def head_bytes(head_dim: int) -> int:
    """Bytes of one head's keys (or values) of one token in Q8_0."""
    check_head_dim(head_dim)
    return head_dim // Q8_0_GROUP * Q8_0_BYTES


def check_head_dim(head_dim: int) -> None:
    if head_dim % Q8_0_GROUP:
        raise ValueError(f"--kv-cache-dtype q8_0 needs a head size that is a multiple of {Q8_0_GROUP}, "
                         f"this model's is {head_dim}")


def is_q8_0(pool_layer: torch.Tensor) -> bool:
    """Whether a pool layer holds Q8_0 blocks (a float pool holds floats)."""
    return pool_layer.dtype == torch.uint8


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (float) as Q8_0 bytes ``[..., head_dim // 32 * 34]``, uint8."""
    *lead, head_dim = x.shape
    groups = x.float().reshape(*lead, head_dim // Q8_0_GROUP, Q8_0_GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    values = torch.round(groups * inverse).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.to(torch.float16).view(torch.uint8)
    return torch.cat([scale_bytes, values.view(torch.uint8)], -1).reshape(*lead, -1)


def dequantize_q8_0(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q8_0 bytes ``[..., groups * 34]`` back to ``[..., groups * 32]`` in ``dtype``."""
    *lead, size = blocks.shape
    grouped = blocks.reshape(*lead, size // Q8_0_BYTES, Q8_0_BYTES)
    scale = grouped[..., :2].contiguous().view(torch.float16).float()
    values = grouped[..., 2:].contiguous().view(torch.int8).float()
    return (values * scale).reshape(*lead, -1).to(dtype)


def write_slots(pool_layer: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """Store ``kv`` ``[T, 2, kv_heads, head_dim]`` at the pool's slots ``slot_mapping`` ``[T]``."""
    slots = pool_layer.view(-1, *pool_layer.shape[2:])
    slots.index_copy_(0, slot_mapping, quantize_q8_0(kv) if is_q8_0(pool_layer) else kv)


def read_slots(pool_layer: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys and values at ``slots`` ``[n]``: ``[n, 2, kv_heads, head_dim]`` in ``dtype`` (a float pool's own)."""
    rows = pool_layer.view(-1, *pool_layer.shape[2:]).index_select(0, slots)
    return dequantize_q8_0(rows, dtype) if is_q8_0(pool_layer) else rows
