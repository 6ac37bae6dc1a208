"""The forward's RMSNorms: the CPU kernels of csrc/rms_norm.cpp where they are built, torch's elsewhere.

``add_rms_norm_`` adds a layer's output into the residual stream and norms the
result in one pass, as the forward does before each norm. The kernels take
float32 CPU rows; anything else (CUDA, other dtypes, a CPU without the built
kernels, ``TIERGATE_FUSED_NORMS=0``) goes through ``torch.nn.functional.rms_norm``.
The same switch turns the forward's other fused CPU kernels (rope, the SiLU gate:
csrc/pointwise.cpp) on and off with these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_build import cpu_kernels_loaded
from tiergate_common.env import FUSED_NORMS


def fused_norms_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the forward on this device and dtype uses the fused kernels."""
    if FUSED_NORMS.get() == "off":
        return False
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_loaded()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dimension of ``x [rows, hidden]``."""
    if fused and x.dim() == 2 and x.stride(-1) == 1:
        return torch.ops.tiergate.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  fused: bool) -> torch.Tensor:
    """``residual += delta`` in place, then its RMSNorm."""
    if fused and residual.dim() == 2 and residual.stride(-1) == 1 and delta.stride(-1) == 1:
        return torch.ops.tiergate.add_rms_norm_(residual, delta, weight, eps)
    residual.add_(delta)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
