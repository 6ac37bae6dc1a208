"""Transparent huge pages for the big buffers a step streams through: the weights and the KV pool.

A decode step reads hundreds of MB spread over many small runs; with 4 KB pages that is a TLB miss
every 4 KB. With THP in ``madvise`` mode (the common default) Linux gives no buffer huge pages unless
asked, and it must be asked before the pages are first touched. Used for the weights
(engine/packed_linear.py, engine/quant_linear.py) and the KV pool (engine/kv_cache.py); the LoRA
stacks measured no faster on them (bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's value on every architecture torch ships for


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back the 2 MB-aligned inside of ``tensor``'s memory with transparent huge pages (a no-op
    where THP is off or the call is missing), before its pages are first touched."""
    address = tensor.data_ptr()
    first, last = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(first, last - first, MADV_HUGEPAGE)
