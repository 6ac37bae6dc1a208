"""Float64 reference for the batched LoRA update, and random cases shared by the op tests."""

from __future__ import annotations

import torch


def reference(x, y, a, b, scales, row_slots, ranks) -> torch.Tensor:
    """y + per row (x @ A[slot, :r].T) @ B[slot, :, :r].T * scale, in float64."""
    out = y.to(torch.float64).clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            r = ranks[slot]
            shrink = x[row].double() @ a[slot, :r].double().T
            out[row] += shrink @ b[slot, :, :r].double().T * float(scales[slot])
    return out


def random_case(chunks: list[tuple[int, int]], fan_in: int, fan_out: int, ranks: list[int],
                max_rank: int, dtype=torch.float32, seed: int = 0):
    """Stacks zero-padded past each slot's rank, as the pool keeps them, and a batch."""
    gen = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    a = torch.zeros(slots, max_rank, fan_in, dtype=dtype)
    b = torch.zeros(slots, fan_out, max_rank, dtype=dtype)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, fan_in, generator=gen).to(dtype)
        b[s, :, :r] = torch.randn(fan_out, r, generator=gen).to(dtype)
    scales = torch.rand(slots, generator=gen) + 0.5
    rows = sum(n for _, n in chunks)
    x = torch.randn(rows, fan_in, generator=gen).to(dtype)
    y = torch.randn(rows, fan_out, generator=gen).to(dtype)
    return x, y, a, b, scales


# chunk lists: (slot or -1, rows), in row order
CASES = {
    "decode_interleaved": [(i % 3, 1) for i in range(7)] + [(-1, 1)],
    "decode_even_slots_out_of_order": [(2, 1), (0, 1), (1, 1), (2, 1), (0, 1), (1, 1)],  # no padding
    "prefill_segments": [(1, 5), (-1, 3), (0, 17), (1, 2)],
    "mixed": [(2, 9), (0, 1), (-1, 1), (2, 1), (1, 4), (0, 1)],
    "long_prefill": [(0, 70), (-1, 2), (1, 3)],  # segments longer than one kernel block
}
