"""The model's projections on CPU through oneDNN, with each weight packed once at load.

MKL's fp32 GEMM behind ``torch.mm`` re-packs its weight operand on every call
and, on AMD CPUs, takes a slower code path; oneDNN's linear takes a weight
reordered once into its blocked layout (``_reorder_linear_weight``) and only
reads it per call. Both ops are private to torch, so they are used only on the
torch releases they were checked against (``PACKED_OPS_TORCH``) and only where
oneDNN is built in; anywhere else (CUDA, other dtypes, another torch, or
``TIERGATE_PACKED_WEIGHTS=0``) a projection is a plain ``[in, out]`` weight
multiplied with ``torch.mm``. Packing replaces the plain weight, so memory does
not grow.
"""

from __future__ import annotations

import ctypes
import os

import torch

# The torch releases whose private mkldnn linear ops this module calls with these
# signatures; tests/engine/test_packed_linear.py fails when the installed torch is not one.
PACKED_OPS_TORCH = ("2.13.",)
# The batch-size hint oneDNN picks the packed layout for: one layout serves every row
# count (decode rows to prefill chunks), and 32 kept small batches fast too.
PACK_HINT_ROWS = 32


def _ops_present() -> bool:
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether projections on this device and dtype are packed (see the module docstring)."""
    if os.environ.get("TIERGATE_PACKED_WEIGHTS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.__version__.startswith(PACKED_OPS_TORCH)
        and torch.backends.mkldnn.is_available()
        and _ops_present()
    )


class PackedWeight:
    """A projection weight in oneDNN's blocked layout; ``x [rows, in] -> [rows, out]``."""

    def __init__(self, weight_in_out: torch.Tensor) -> None:
        self.in_features, self.out_features = weight_in_out.shape
        # oneDNN wants the weight [out, in], as F.linear does.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(), PACK_HINT_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def dense(self) -> torch.Tensor:
        """The plain ``[in, out]`` weight back (a new tensor, exact)."""
        return self.packed.to_dense().t().contiguous()


Weight = torch.Tensor | PackedWeight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ weight`` for a plain ``[in, out]`` weight or a packed one."""
    if isinstance(weight, PackedWeight):
        return weight(x)
    return torch.mm(x, weight)


def release_freed_heap() -> None:
    """Hand the heap pages freed by packing back to the OS (glibc only; elsewhere a no-op).

    Packing frees the plain weights and the transposed copies oneDNN reorders from, a few MB
    each; glibc keeps such freed chunks inside the heap rather than returning them, and the
    process stayed about that much larger than the unpacked engine.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def dense(weight: Weight) -> torch.Tensor:
    """The plain ``[in, out]`` weight behind either form."""
    return weight.dense() if isinstance(weight, PackedWeight) else weight
