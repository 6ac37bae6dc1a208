"""Measures candidate CPU paths for the batched LoRA update (the choice in lora_pool/ops.py).

    .venv/bin/python -m bench.kernels.lora_cpu_ops

Shapes are the bundled model's (hidden 576, intermediate 1536), rank 16, float32, one
thread. Row bookkeeping is done once per step in every candidate, as in LoraBatch:
- `segments`: a shrink/expand matmul pair per contiguous run of rows with the same adapter;
- `grouped`: a pair per distinct adapter, slices for a contiguous group,
  index_select/index_add_ otherwise;
- `gather_bmm`: every row gathers its own A and B, two batched matmuls per projection;
- `hybrid` (lora_pool.ops): `grouped` for an adapter whose rows form a run of >= 8 (or
  number >= 64), one padded bmm over the slot stacks (no weight copies) for the others.
Reported: the best of 20 runs in microseconds, next to the base projection's own matmul.
"""

from __future__ import annotations

import time

import torch

from lora_pool import ops


def runs_of(row_slots: list[int]) -> list[tuple[int, int, int]]:
    runs, start = [], 0
    for row in range(1, len(row_slots) + 1):
        if row == len(row_slots) or row_slots[row] != row_slots[start]:
            if row_slots[start] >= 0:
                runs.append((start, row, row_slots[start]))
            start = row
    return runs


def segments(x, y, a, b, runs, scale):
    for start, end, s in runs:
        y[start:end].addmm_(x[start:end] @ a[s].T, b[s].T, alpha=scale)


def grouped(x, y, a, b, groups, scale):
    for rows in groups:
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ a[0].T, b[0].T, alpha=scale)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[0].T) @ b[0].T, alpha=scale)


def gather_bmm(x, y, a, b, rows, slots, scale):
    t = torch.bmm(x[rows].unsqueeze(1), a[slots].transpose(1, 2))
    y.index_add_(0, rows, torch.bmm(t, b[slots].transpose(1, 2)).squeeze(1), alpha=scale)


def best_of(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e6


def main() -> None:
    torch.manual_seed(0)
    num_slots, rank = 16, 16
    cases = {
        "decode 32 rows / 16 adapters interleaved": [i % 16 for i in range(32)],
        "decode 32 rows / 4 adapters + base": [(i % 5) - 1 for i in range(32)],
        "decode 32 rows / 4 adapters interleaved": [i % 4 for i in range(32)],
        "prefill 4x64 rows / 4 adapters": [s for s in range(4) for _ in range(64)],
        "2x64 prefill + 32 decode / 8 adapters": [0] * 64 + [1] * 64 + [i % 8 for i in range(32)],
    }
    for fan_in, fan_out in [(576, 576), (576, 1536), (1536, 576)]:
        a = torch.randn(num_slots, rank, fan_in)
        b = torch.randn(num_slots, fan_out, rank)
        weight = torch.randn(fan_out, fan_in)
        for case, row_slots in cases.items():
            x = torch.randn(len(row_slots), fan_in)
            y = torch.zeros(len(row_slots), fan_out)
            plan = ops.plan_rows(row_slots, {s: (rank, 0.5) for s in range(num_slots)})
            groups = [ops.plan_rows([1 if s == slot else -1 for s in row_slots], {1: (rank, 0.5)}).groups[1].rows
                      for slot in sorted(set(row_slots) - {-1})]
            runs = runs_of(row_slots)
            idx = torch.tensor(row_slots)
            rows = (idx >= 0).nonzero().flatten()
            slots = idx[rows]
            stacks = ops.LayerStacks.of(a, (b.transpose(1, 2),))
            times = {
                "base matmul": best_of(lambda: x @ weight.T),
                "segments": best_of(lambda: segments(x, y, a, b, runs, 0.5)),
                "grouped": best_of(lambda: grouped(x, y, a, b, groups, 0.5)),
                "gather_bmm": best_of(lambda: gather_bmm(x, y, a, b, rows, slots, 0.5)),
                "hybrid": best_of(lambda: ops.apply_group(x, y, stacks, plan, list(range(num_slots)))),
            }
            print(f"{fan_in:>4}->{fan_out:<4} {case:<40} " + "  ".join(f"{k} {v:7.0f}" for k, v in times.items()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with torch.no_grad():
        main()
