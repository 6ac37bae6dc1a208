"""The per-step LoRA batch: which slot each row uses, and `apply` for the model's projections.

`SlotStacks` are the device slots' weights, which the pool allocates and fills and each batch
reads. Built by `LoraPool.batch_for` once per step; implements engine/lora_hook.py's
LoraBatchLike structurally. Row bookkeeping (groups of rows per slot, sorted order
for the kernels) is done here once, not in every one of the step's `apply` calls.
`apply` takes a single projection or a fused group ("qkv", "gate_up"): on CPU a group
shares one shrink over its fused A stacks; on CUDA the kernels run per projection on
column slices of the fused output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lora_pool import ops

if TYPE_CHECKING:
    from lora_pool.adapter import AdapterSpec


@dataclass(frozen=True)
class SlotStacks:
    """Every slot's adapter weights, stacked per projection and zero-padded to ``max_rank``.

    A [layers, slots, rank, in] and B [layers, slots, out, rank] per projection, indexed alike on
    every device; on CPU they are views of ops.cpu_stacks' layout (q/k/v and gate/up A fused), and
    ``cpu_views`` holds each hook's per-layer views. ``widths``: the output width of each name
    ``LoraBatch.apply`` accepts (a projection or a fused group).
    """

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    scales: torch.Tensor  # [slots], float32
    cpu_views: dict[str, list[ops.LayerStacks]]
    widths: dict[str, int]
    max_rank: int
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.b.values())).dtype

    @classmethod
    def allocate(cls, projections: dict[str, tuple[int, int]], num_layers: int, slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> SlotStacks:
        """Zeroed stacks for ``slots`` adapters of up to ``max_rank`` on ``device``."""
        widths = ops.hook_names(projections)
        cpu_views: dict[str, list[ops.LayerStacks]] = {}
        if device.type == "cpu":
            a, b, fused_a = ops.cpu_stacks(projections, num_layers, slots, max_rank, dtype)
            cpu_views = ops.layer_views(a, b, fused_a, list(widths))
        else:
            a = {proj: torch.zeros(num_layers, slots, max_rank, fan_in, dtype=dtype, device=device)
                 for proj, (fan_in, _) in projections.items()}
            b = {proj: torch.zeros(num_layers, slots, fan_out, max_rank, dtype=dtype, device=device)
                 for proj, (_, fan_out) in projections.items()}
        scales = torch.zeros(slots, dtype=torch.float32, device=device)
        return cls(a, b, scales, cpu_views, widths, max_rank, device)


class LoraBatch:
    def __init__(self, stacks: SlotStacks, chunk_slots: list[tuple[int, int]], specs: dict[int, AdapterSpec],
                 cpu_kernel: bool = False, prefetch_to: int = 1):
        """`chunk_slots`: each chunk's (slot, or -1 without adapter, number of rows) in row order;
        `cpu_kernel`: the CPU rows run on ``ops.rows_kernel`` (the pool checked it is there), reading the
        stacks ahead into cache level `prefetch_to` (``ops.prefetch_level``)."""
        self._a = stacks.a
        self._b = stacks.b
        self._cpu_views = stacks.cpu_views
        row_slots = [slot for slot, rows in chunk_slots for _ in range(rows)]
        self.num_rows = len(row_slots)
        self.specs = specs
        # Per projection or fused group, the slots of this step whose adapter touches it
        # (others are skipped), and the width of the output it writes.
        self.slots_by_name = {name: [s for s in sorted(specs)
                                     if not specs[s].targets.isdisjoint(ops.projections_of(name))]
                              for name in stacks.widths}
        self._width = stacks.widths
        if stacks.device.type == "cuda":
            from lora_pool.triton_ops import KernelPlan  # triton is only needed on CUDA

            self._kernel_plan = KernelPlan.build(chunk_slots, stacks.scales, stacks.max_rank, stacks.device)
        else:
            self._kernel_plan = None
            self._cpu_plan = ops.plan_rows(row_slots, {s: (spec.rank, spec.scale) for s, spec in specs.items()},
                                           cpu_kernel, prefetch_to)

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """In place: y += (x @ A[slot].T) @ B[slot].T * scale[slot] for each row with an adapter.

        `proj` is a projection or a fused group; for a group `y` holds its projections'
        outputs side by side in the group's order.
        """
        slots = self.slots_by_name[proj]
        if not slots:
            return
        if x.shape[0] != self.num_rows or y.shape[0] != self.num_rows:
            raise ValueError(f"LoRA batch has {self.num_rows} rows but x has {x.shape[0]}, y {y.shape[0]}")
        if y.shape[1] != self._width[proj]:
            raise ValueError(f"LoRA {proj!r} writes {self._width[proj]} columns but y has {y.shape[1]}")
        projs = ops.projections_of(proj)
        if self._kernel_plan is not None:
            from lora_pool.triton_ops import run_kernels

            col = 0
            for p in projs:
                width = self._b[p].shape[2]
                if self.slots_by_name[p]:
                    run_kernels(x, y[:, col: col + width], self._a[p][layer], self._b[p][layer], self._kernel_plan)
                col += width
            return
        ops.apply_group(x, y, self._cpu_views[proj][layer], self._cpu_plan, slots)
