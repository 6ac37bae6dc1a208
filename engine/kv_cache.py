"""The paged KV cache: one tensor per layer holding keys and values in fixed-size blocks.

Layout ``[num_blocks, block_size, 2, kv_heads, head_dim]`` (2 = key, value):
a token's slot (``block * block_size + offset``) is one row of the flattened
view, and keys sit next to values, so a step writes its new K and V with one
``index_copy_`` per layer and a decode batch gathers its context with one
indexing op, half the eager ops of separate K and V tensors (about 10 µs
each, times 30 layers, on the 2-core CPU). A pool in the 8-bit format
(``kv_cache_dtype`` "q8_0", engine/kv_quant.py) holds each head as Q8_0 bytes instead:
``[num_blocks, block_size, 2, kv_heads, head_dim // 32 * 34]`` uint8.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.huge_pages import advise_huge_pages
from engine.kv_quant import KVDtype, head_bytes
from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

# The default pool (neither bytes nor tokens given): this fraction of the memory still available once
# the weights are loaded (MemAvailable on CPU, free device memory on CUDA), as vLLM sizes its pool
# from a utilization fraction; a fraction, not all, as the machine's other processes need theirs.
AVAILABLE_FRACTION = 0.5
# ... at most what every batch slot needs with a quarter of the context each (more is never used
# unless every sequence runs long, and a CPU box's resident memory stays near the weights'), and
# at least one sequence of the whole context.
CONTEXT_SHARE_CAP = 4


@dataclass
class KVCache:
    layers: list[torch.Tensor]  # per layer [num_blocks, block_size, 2, kv_heads, head_dim (or its Q8_0 bytes)]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device, dtype: KVDtype
    ) -> KVCache:
        """``dtype``: the model's float dtype, or "q8_0" for the 8-bit pool (CPU only)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if dtype == "q8_0" and torch.device(device).type != "cpu":
            raise ValueError("--kv-cache-dtype q8_0 is read by the CPU attention kernel only; on CUDA leave it auto")
        dtype, head = head_storage(config, dtype)
        shape = (config.num_layers, num_blocks, block_size, 2, config.num_kv_heads, head)
        # One allocation for everything, so the pool is one contiguous region; on the CPU on huge pages,
        # asked for before the zeros touch them: attention reads a context's blocks from all over it.
        pool = torch.empty(shape, device=device, dtype=dtype)
        if pool.device.type == "cpu":
            advise_huge_pages(pool)
        pool.zero_()
        return cls(layers=list(pool.unbind(0)), block_size=block_size)


def head_storage(config: ModelConfig, dtype: KVDtype) -> tuple[torch.dtype, int]:
    """The pool's element type and elements per stored head: the float dtype and the head's size, or a
    Q8_0 head's bytes (engine/kv_quant.py)."""
    if dtype == "q8_0":
        return torch.uint8, head_bytes(config.head_dim)
    return dtype, config.head_dim


def bytes_per_block(config: ModelConfig, block_size: int, dtype: KVDtype) -> int:
    """K and V of every layer for one block of tokens."""
    element, head = head_storage(config, dtype)
    return 2 * config.num_layers * block_size * config.num_kv_heads * head * element.itemsize


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: KVDtype, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``; at least one, so a tiny budget still runs."""
    return max(1, int(budget_bytes) // bytes_per_block(config, block_size, dtype))


def bytes_per_token(config: ModelConfig, dtype: KVDtype) -> int:
    return bytes_per_block(config, 1, dtype)


def available_memory(device: str | torch.device) -> int:
    """Bytes this process may still take: free device memory on CUDA, MemAvailable on Linux."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_pool_bytes(config: ModelConfig, dtype: KVDtype, available: int, max_num_seqs: int,
                       max_model_len: int) -> int:
    """The pool's size when none is asked for: ``AVAILABLE_FRACTION`` of ``available``, capped at
    ``max_num_seqs`` sequences of a ``CONTEXT_SHARE_CAP``-th of the context, at least one whole context."""
    per_token = bytes_per_token(config, dtype)
    cap = max_num_seqs * max(1, max_model_len // CONTEXT_SHARE_CAP) * per_token
    return max(min(int(available * AVAILABLE_FRACTION), cap), max_model_len * per_token)


def pool_blocks(config: ModelConfig, block_size: int, dtype: KVDtype, device: str | torch.device,
                memory_bytes: int | None, tokens: int | None, max_num_seqs: int, max_model_len: int) -> int:
    """The pool's blocks: ``memory_bytes`` or ``tokens`` when given, else ``default_pool_bytes``."""
    if memory_bytes is not None and tokens is not None:
        raise ValueError("give the KV pool's size in bytes or in tokens, not both")
    if tokens is not None:
        blocks, how = max(1, -(-tokens // block_size)), f"{tokens} tokens asked"
    else:
        if memory_bytes is None:
            available = available_memory(device)
            memory_bytes = default_pool_bytes(config, dtype, available, max_num_seqs, max_model_len)
            how = f"default: {AVAILABLE_FRACTION:g} of {available / 2**30:.1f} GiB available, capped"
        else:
            how = "bytes asked"
        blocks = num_blocks_for_budget(config, block_size, dtype, memory_bytes)
    size = blocks * bytes_per_block(config, block_size, dtype)
    log.info("KV pool: %d blocks of %d tokens (%d tokens, %.0f MiB in %s; %s)", blocks, block_size, blocks * block_size,
             size / 2**20, str(dtype).removeprefix("torch."), how)
    return blocks
