"""The one seam between the model's projections and lora_pool's batched LoRA.

The model calls ``lora.apply(layer, name, x, y)`` after each base projection;
lora_pool's per-step batch object implements it. Keeping the protocol here
lets the model stay ignorant of slots, kernels and adapters.

``name`` is a projection, or a fused group whose projections share ``x`` and
whose outputs sit side by side in ``y`` (the model fuses q/k/v and gate/up
into one matmul each): one call per group lets the batch share one shrink
over the group's A stacks instead of three.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Fused groups and their projections in column order: lora_pool owns the table (it may not
# import the engine); the model's fused weights follow it. Re-exported as part of the protocol.
from lora_pool.ops import FUSED_GROUPS

__all__ = ["FUSED_GROUPS", "PROJECTIONS", "LoraBatchLike"]

# Projection names as peft's target_modules spell them, shortened.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class LoraBatchLike(Protocol):
    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """In place: ``y += (x @ A[idx]) @ B[idx] * scale[idx]`` for each row's adapter.

        ``proj`` is one of ``PROJECTIONS`` or of ``FUSED_GROUPS``. ``x`` is
        [rows, in_features] and ``y`` [rows, out_features] (for a group, the
        group's projections' outputs in order; ``y`` may also be a column slice
        of a wider output). Rows are the step's tokens in the order of
        ``StepPlan.chunks``; rows without an adapter are untouched.
        """
        ...
