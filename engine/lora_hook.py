"""The one seam between the model's projections and lora_pool's batched LoRA.

The model calls ``lora.apply(layer, proj, x, y)`` after each base projection;
lora_pool's per-step batch object implements it. Keeping the protocol here
lets the model stay ignorant of slots, kernels and adapters.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Projection names as peft's target_modules spell them, shortened.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class LoraBatchLike(Protocol):
    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """In place: ``y += (x @ A[idx]) @ B[idx] * scale[idx]`` for each row's adapter.

        ``x`` is [rows, in_features] and ``y`` [rows, out_features] (``y`` may be a
        column slice of a fused qkv or gate/up output). Rows are the step's tokens
        in the order of ``StepPlan.chunks``; rows without an adapter are untouched.
        """
        ...
