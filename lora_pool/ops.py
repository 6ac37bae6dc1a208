"""Batched LoRA on CPU in plain torch, planned once per step, applied per projection.

Adapters with many rows in the step (prefill chunks) get their own shrink/expand matmul
pair, on slices when the rows are contiguous and at the adapter's own rank; adapters
with few rows (decodes) share one padded bmm pair over a view of the slot stacks, so the
op count per projection stays constant however many adapters the step mixes.

Chosen by measurement (bench/lora_cpu_ops.py; bundled model's shapes, rank 16, float32,
one thread, best of 20, on the shared and noisy 2-core box), microseconds for 576->1536:
  case                                   base  segments grouped gather_bmm  this
  decode 32 rows / 16 adapters            654     1165     708       1718    296
  decode 32 rows / 4 adapters interleaved 741     1103     190       1617    169
  decode 32 rows / 4 adapters + base      694      878     183       1389    166
  prefill 4x64 rows / 4 adapters         4177      464     447      11894  ~450 (= grouped)
  2x64 prefill + 32 decode / 8 adapters  2452     1259     594       7128    551
Per-run segments pay per run, per-adapter matmuls pay per adapter (~30 us of op overhead
each), and gathering each row's A/B copies rows x rank x features of weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEASUREMENT_NOTE = "filled in below"


@dataclass(frozen=True)
class RowGroup:
    """The rows of one adapter in a step: a slice when contiguous, else an index tensor."""

    slot: int
    rows: slice | torch.Tensor
    rank: int
    scale: float


@dataclass(frozen=True)
class PaddedRows:
    """Few rows each of many adapters (decodes), laid out [slots lo..hi, max_rows] for bmm.

    `gather` picks x rows into that layout (padding repeats row 0), `valid` the real
    entries of the flattened result and `rows` the y rows they belong to.
    """

    lo: int
    hi: int
    max_rows: int
    gather: torch.Tensor
    valid: torch.Tensor | None  # None when nothing is padding (equal rows per slot, no gaps)
    rows: torch.Tensor
    scales: torch.Tensor  # [hi - lo, 1, 1]
    slots: frozenset[int]


@dataclass(frozen=True)
class CpuPlan:
    groups: dict[int, RowGroup]
    padded: PaddedRows | None


# Rows of one adapter that amortise their own matmul pair: a contiguous run (a prefill
# chunk, no copies) this long, or any set this large (worth an index_select/index_add_).
BIG_RUN = 8
BIG_SCATTERED = 64


def _own_matmuls(rows: list[int]) -> bool:
    contiguous = rows[-1] - rows[0] + 1 == len(rows)
    return len(rows) >= (BIG_RUN if contiguous else BIG_SCATTERED)


def plan_rows(row_slots: list[int], slot_info: dict[int, tuple[int, float]]) -> CpuPlan:
    """Group the step's rows by slot; `slot_info` maps slot -> (rank, scale)."""
    positions: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            positions.setdefault(slot, []).append(row)
    small = {slot: rows for slot, rows in positions.items() if not _own_matmuls(rows)}
    if len(small) < 2:
        small = {}
    groups = {}
    for slot, rows in positions.items():
        if slot not in small:
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
            groups[slot] = RowGroup(slot, index, *slot_info[slot])
    return CpuPlan(groups, _padded(small, slot_info) if small else None)


def _padded(small: dict[int, list[int]], slot_info: dict[int, tuple[int, float]]) -> PaddedRows:
    lo, hi = min(small), max(small) + 1
    max_rows = max(len(rows) for rows in small.values())
    gather, valid, rows_out = [0] * ((hi - lo) * max_rows), [], []
    scales = torch.zeros(hi - lo, 1, 1)
    for slot, rows in sorted(small.items()):  # layout order, which `valid` and `rows` follow
        base = (slot - lo) * max_rows
        gather[base: base + len(rows)] = rows
        valid.extend(range(base, base + len(rows)))
        rows_out.extend(rows)
        scales[slot - lo] = slot_info[slot][1]
    no_padding = len(valid) == len(gather)
    return PaddedRows(lo, hi, max_rows, torch.tensor(gather), None if no_padding else torch.tensor(valid),
                      torch.tensor(rows_out), scales, frozenset(small))


def apply_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: CpuPlan,
               slots: list[int]) -> None:
    """In place: y[rows] += (x[rows] @ a[slot, :r].T) @ b[slot, :, :r].T * scale, for `slots`.

    `a` is [slots, max_rank, in] and `b` [slots, out, max_rank], one layer's stacks.
    """
    for slot in slots:
        g = plan.groups.get(slot)
        if g is None:
            continue
        a_t = a[g.slot, : g.rank].T
        b_t = b[g.slot, :, : g.rank].T
        if isinstance(g.rows, slice):
            y[g.rows].addmm_(x[g.rows] @ a_t, b_t, alpha=g.scale)
        else:
            y.index_add_(0, g.rows, (x.index_select(0, g.rows) @ a_t) @ b_t, alpha=g.scale)
    p = plan.padded
    if p is not None and not p.slots.isdisjoint(slots):
        xs = x.index_select(0, p.gather).view(p.hi - p.lo, p.max_rows, x.shape[1])
        shrunk = torch.bmm(xs, a[p.lo: p.hi].transpose(1, 2)).mul_(p.scales)
        out = torch.bmm(shrunk, b[p.lo: p.hi].transpose(1, 2)).view(-1, y.shape[1])
        y.index_add_(0, p.rows, out if p.valid is None else out.index_select(0, p.valid))
