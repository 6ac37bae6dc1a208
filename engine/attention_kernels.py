"""The attention kernels the runner picks: paged decode attention, and causal attention for prefill chunks.

Decode: each decode row attends to its context read from the block pool in place.

A kernel is called as ``kernel(q, kv_cache, block_tables, context_lens, scale,
window, softcap)`` with ``q`` ``[B, heads, head_dim]`` (rows may be strided), one
layer of the cache ``[blocks, block_size, 2, kv_heads, head_dim]``, int64 block
tables ``[B, max_blocks]``, int64 context lengths ``[B]``, a sliding window
(0: none) and a score soft-cap (0.0: none); it returns ``[B, heads * head_dim]``. Without a kernel, attention.py gathers each context
into a padded copy and runs SDPA over it, which is the fallback.

- CPU: a C++ operator (csrc/paged_attention.cpp) built on first use by
  engine/cpu_build.py. When it cannot be built, the engine keeps the gathered path.
- CUDA: the Triton kernel of engine/triton_paged_attention.py.

Prefill: a chunk attends causally to its context and its own keys. On the CPU a C++
operator (csrc/prefill_attention.cpp) serves float32 with head dims that are a multiple
of 16 (up to 256) and no soft-cap; everything else, and CUDA, runs torch's SDPA.

``TIERGATE_PAGED_ATTENTION=off`` keeps the gathered path and SDPA for both on every device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from engine.cpu_build import cpu_kernels_loaded
from tiergate_common.env import PAGED_ATTENTION

log = logging.getLogger(__name__)

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, float], torch.Tensor]
# (q [n, heads, d], k [m, kv_heads, d], v [m, kv_heads, d], scale, window, query_offset = m - n)
# -> [n, heads * d]: query i at key position query_offset + i.
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int, int], torch.Tensor]
PREFILL_KERNEL_MAX_HEAD_DIM = 256
CPU_DECODE_MAX_HEAD_DIM = 263  # csrc/paged_attention.cpp: 256 in whole vectors and a partial one (of 8 on AVX2)


def _kernels_off() -> bool:
    return PAGED_ATTENTION.get() == "off"


def decode_kernel_for(device: torch.device | str, head_dim: int = 0) -> DecodeKernel | None:
    """The in-place kernel for ``device`` (and heads of ``head_dim``), or None where the gathered
    path must serve."""
    if _kernels_off():
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_decode_kernel() if head_dim <= CPU_DECODE_MAX_HEAD_DIM else None
    if kind == "cuda":
        return cuda_decode_kernel()
    return None


def prefill_kernel_for(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> PrefillKernel | None:
    """The causal prefill kernel for these shapes on ``device``, or None where SDPA must serve."""
    if _kernels_off() or torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    if head_dim % 16 or head_dim > PREFILL_KERNEL_MAX_HEAD_DIM or not cpu_kernels_loaded():
        return None
    return torch.ops.tiergate.prefill_attention


@functools.cache
def cpu_decode_kernel() -> DecodeKernel | None:
    """Build (or find already built) and load the C++ operator, once per process."""
    if not cpu_kernels_loaded():
        return None
    return torch.ops.tiergate.paged_decode_attention


@functools.cache
def cuda_decode_kernel() -> DecodeKernel | None:
    try:
        from engine.triton_paged_attention import paged_decode_attention
    except Exception as error:  # triton missing or broken: the gathered path still works
        log.warning("Triton paged attention kernel unavailable, decode attention gathers contexts instead: %s", error)
        return None
    return paged_decode_attention
