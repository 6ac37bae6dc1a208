"""Batched LoRA on CPU in plain torch, planned once per step, applied per fused projection group.

Adapters with many rows in the step (prefill chunks) get their own shrink/expand matmuls,
on slices when the rows are contiguous; adapters with few rows (decodes) share one padded
bmm over a view of the slot stacks, so the op count per group stays constant however many
adapters the step mixes.

Layout (`cpu_stacks`): the engine fuses q/k/v and gate/up into one matmul each, and their
LoRA A stacks are fused the same way, along the rank: one [slots, in, 3 * rank] stack per
layer for qkv, so the three projections share one gather of x, one shrink bmm and one
index_add_ into the fused output. Stacks are stored transposed ([in, rank] and [rank, out]
per slot): MKL's bmm reads B far faster that way (576->1536, 16 slots x 2 rows, 30 layers
cycled, shrink + expand 182 us per layer against 279 us through a transposed view).

Measured on the shared 2-core box (load 1-2; compare within a line only), one thread:
- decode step of the bundled model, 32 rows, ~40 tokens of context, adapters of ranks 8
  and 16 alternating on all seven projections, max_lora_rank 16 (median-ish of 12):
    adapters                        1     4     16
    before (a call per projection)  0.94  0.85  0.75  x base-only step time
    fused groups (this)             0.94  0.86  0.79
  At 16 adapters the LoRA part is ~46 ms of a ~220 ms step, ~32 ms of it the bmms
  reading 312 MB of stacks (16 slots x 30 layers, rank padding included) at the ~10 GB/s
  one core reads here (a plain sum() over 300 MB: 11 GB/s): bytes, not op count, bound it.
- bench/lora_cpu_ops.py, microseconds for 576->1536 (rank 16, float32, best of 20),
  per projection before the fused groups:
    case                                   base  segments grouped gather_bmm  this
    decode 32 rows / 16 adapters            654     1165     708       1718    296
    decode 32 rows / 4 adapters interleaved 741     1103     190       1617    169
    prefill 4x64 rows / 4 adapters         4177      464     447      11894  ~450 (= grouped)
    2x64 prefill + 32 decode / 8 adapters  2452     1259     594       7128    551
  Per-run segments pay per run, per-adapter matmuls pay per adapter (~30 us of op overhead
  each), and gathering each row's A/B copies rows x rank x features of weights.
- index_add_ into a column slice of a fused output: 63 us for 32x1536, against 8 us into
  a contiguous tensor; hence one index_add_ into the whole fused output per group.
- bfloat16 stacks (this CPU has avx512_bf16 and amx_bf16) were not faster for these
  shapes, so the stacks stay in the model's dtype: per layer, 16 slots x 2 rows, us
  float32 / bfloat16 bmm: 576->576 49 / 116, 576->1536 182 / 201, 1536->576 199 / 186,
  576->3072 330 / 277; converting bfloat16 stacks to float32 before a float32 bmm cost
  more than it saved (shrink 576x48: 129 -> 188 us); and in the decode step above, 16
  adapters gave 0.77 (float32), 0.75 (bfloat16 stored, float32 bmm), 0.73 (bfloat16 bmm).
  (2-D bfloat16 mm, by contrast, runs ~3x float32 here: 32x576x3072 in 578 against
  1770 us; it is the batched small matrices that gain nothing.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The engine's fused projection outputs, columns in this order (engine/model.py's layout);
# engine/lora_hook.py takes this table for its protocol, as lora_pool imports nothing of the engine.
FUSED_GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def projections_of(name: str) -> tuple[str, ...]:
    """The projections a LoRA hook call covers: a fused group's, or the projection itself."""
    return FUSED_GROUPS.get(name, (name,))


def hook_names(projections: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Every name a LoRA hook call may use (projections, and the groups all of whose
    projections exist) -> the width of the output it writes."""
    names = [*projections, *(g for g, projs in FUSED_GROUPS.items() if all(p in projections for p in projs))]
    return {name: sum(projections[p][1] for p in projections_of(name)) for name in names}


def cpu_stacks(projections: dict[str, tuple[int, int]], num_layers: int, num_slots: int, max_rank: int,
               dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Zeroed stacks in the CPU layout: (a, b, fused_a).

    `a[proj]` is [layers, slots, rank, in] and `b[proj]` [layers, slots, out, rank] as on
    every device, but as transposed views; `fused_a[group]` is the storage the group's
    `a` views share, [layers, slots, in, projections * rank].
    """
    a, b, fused_a = {}, {}, {}
    for group, projs in FUSED_GROUPS.items():
        if not all(p in projections for p in projs):
            continue
        fan_in = projections[projs[0]][0]
        fused_a[group] = torch.zeros(num_layers, num_slots, fan_in, len(projs) * max_rank, dtype=dtype)
        for i, proj in enumerate(projs):
            a[proj] = fused_a[group][..., i * max_rank: (i + 1) * max_rank].transpose(-1, -2)
    for proj, (fan_in, fan_out) in projections.items():
        if proj not in a:
            a[proj] = torch.zeros(num_layers, num_slots, fan_in, max_rank, dtype=dtype).transpose(-1, -2)
        b[proj] = torch.zeros(num_layers, num_slots, max_rank, fan_out, dtype=dtype).transpose(-1, -2)
    return a, b, fused_a


@dataclass(frozen=True)
class LayerStacks:
    """One layer's transposed stacks for one hook name, with their per-slot views.

    Made once (`layer_views`): a step issues ~30 layers x 4 calls, and each view is a
    dispatcher call costing about as much as the tiny matmul it feeds.
    """

    a: torch.Tensor  # [slots, in, len(b) * max_rank]: the projections' A side by side
    b: tuple[torch.Tensor, ...]  # per projection [slots, max_rank, out_p]
    a_slot: tuple[torch.Tensor, ...]  # a[slot]
    b_slot: tuple[tuple[torch.Tensor, ...], ...]  # per projection, b[p][slot]

    @classmethod
    def of(cls, a_t: torch.Tensor, b_ts: tuple[torch.Tensor, ...]) -> LayerStacks:
        return cls(a_t, b_ts, tuple(a_t.unbind(0)), tuple(tuple(b_t.unbind(0)) for b_t in b_ts))


def layer_views(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], fused_a: dict[str, torch.Tensor],
                names: list[str]) -> dict[str, list[LayerStacks]]:
    """Per hook name, per layer, the `LayerStacks` of `cpu_stacks`' stacks."""
    views = {}
    for name in names:
        a_t = fused_a[name] if name in fused_a else a[name].transpose(-1, -2)
        b_ts = [b[p].transpose(-1, -2) for p in projections_of(name)]
        views[name] = [LayerStacks.of(a_t[layer], tuple(b_t[layer] for b_t in b_ts)) for layer in range(a_t.shape[0])]
    return views


@dataclass(frozen=True)
class RowGroup:
    """The rows of one adapter in a step: a slice when contiguous, else an index tensor."""

    slot: int
    rows: slice | torch.Tensor
    rank: int
    scale: float
    count: int  # rows


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
# Up to this many rows, an adapter below max_rank still gets one shrink over its group's
# fused A (padding included): the padding's flops cost less than a matmul per projection.
PADDED_SHRINK_MAX_ROWS = 64


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
            groups[slot] = RowGroup(slot, index, *slot_info[slot], len(rows))
    return CpuPlan(groups, _padded(small, slot_info) if small else None)


def _padded(small: dict[int, list[int]], slot_info: dict[int, tuple[int, float]]) -> PaddedRows:
    lo, hi = min(small), max(small) + 1
    max_rows = max(len(rows) for rows in small.values())
    gather, valid, rows_out = [0] * ((hi - lo) * max_rows), [], []
    scales = [0.0] * (hi - lo)
    for slot, rows in sorted(small.items()):  # layout order, which `valid` and `rows` follow
        base = (slot - lo) * max_rows
        gather[base: base + len(rows)] = rows
        valid.extend(range(base, base + len(rows)))
        rows_out.extend(rows)
        scales[slot - lo] = slot_info[slot][1]
    no_padding = len(valid) == len(gather)
    return PaddedRows(lo, hi, max_rows, torch.tensor(gather), None if no_padding else torch.tensor(valid),
                      torch.tensor(rows_out), torch.tensor(scales).view(-1, 1, 1), frozenset(small))


def apply_group(x: torch.Tensor, y: torch.Tensor, stacks: LayerStacks, plan: CpuPlan, slots: list[int]) -> None:
    """In place, for `slots`: y[rows] += concat_p((x[rows] @ A_p[slot].T) @ B_p[slot].T) * scale.

    `y`'s columns are the stacks' projections' outputs in order. Rank columns past a
    slot's rank are zero, so the padded bmm runs at max_rank for all its slots.
    """
    max_rank = stacks.b[0].shape[1]
    num_rows = x.shape[0]
    for slot in slots:
        g = plan.groups.get(slot)
        if g is None:
            continue
        contiguous = isinstance(g.rows, slice)
        every_row = contiguous and g.rows == slice(0, num_rows)
        xs = x if every_row else x[g.rows] if contiguous else x.index_select(0, g.rows)
        a_slot = stacks.a_slot[slot]
        if g.rank == max_rank or g.count <= PADDED_SHRINK_MAX_ROWS:  # one shrink for the group
            t = torch.mm(xs, a_slot)
            parts = [t[:, i * max_rank: i * max_rank + g.rank] for i in range(len(stacks.b))]
        else:  # at the adapter's rank, as the padding would cost flops on every row
            parts = [torch.mm(xs, a_slot[:, i * max_rank: i * max_rank + g.rank]) for i in range(len(stacks.b))]
        bs = [b_slot[slot] if g.rank == max_rank else b_slot[slot][: g.rank] for b_slot in stacks.b_slot]
        if contiguous:
            y_rows = y if every_row else y[g.rows]
            col = 0
            for part, b in zip(parts, bs):
                y_rows[:, col: col + b.shape[1]].addmm_(part, b, alpha=g.scale)
                col += b.shape[1]
        else:
            y.index_add_(0, g.rows, torch.cat([part @ b for part, b in zip(parts, bs)], dim=1), alpha=g.scale)
    p = plan.padded
    if p is not None and not p.slots.isdisjoint(slots):
        xs = x.index_select(0, p.gather).view(p.hi - p.lo, p.max_rows, x.shape[1])
        a_t, b_ts = stacks.a, stacks.b
        if p.lo != 0 or p.hi != a_t.shape[0]:  # a range of slots; all of them need no slicing views
            a_t, b_ts = a_t[p.lo: p.hi], [b_t[p.lo: p.hi] for b_t in b_ts]
        t = torch.bmm(xs, a_t).mul_(p.scales)
        if len(b_ts) == 1:
            out = torch.bmm(t, b_ts[0])
        else:
            out = torch.cat([torch.bmm(t[:, :, i * max_rank: (i + 1) * max_rank], b_t) for i, b_t in enumerate(b_ts)],
                            dim=2)
        out = out.view(-1, y.shape[1])
        y.index_add_(0, p.rows, out if p.valid is None else out.index_select(0, p.valid))


def apply_projection(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: CpuPlan,
               slots: list[int]) -> None:
    """One projection: y[rows] += (x[rows] @ a[slot, :r].T) @ b[slot, :, :r].T * scale, for `slots`.

    `a` is [slots, max_rank, in] and `b` [slots, out, max_rank], one layer's stacks.
    """
    apply_group(x, y, LayerStacks.of(a.transpose(1, 2), (b.transpose(1, 2),)), plan, slots)
