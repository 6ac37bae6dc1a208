"""Batched LoRA on CPU, planned once per step, applied per fused projection group.

Where the engine's C++ kernels are loaded, every row of the step goes to one C++ call per group,
``torch.ops.tiergate.lora_rows_`` (engine/csrc/lora_rows.cpp), which reads each slot's stacks once
per few rows, in float32 or bfloat16 (the pool's stack dtype), on float32 activations. Where it was
not built, torch serves: adapters with many rows in the step (prefill chunks) get their own
shrink/expand matmuls, on slices when the rows are contiguous; adapters with few rows (decodes)
share one padded bmm over a view of the slot stacks. Either way the op count per group stays
constant however many adapters the step mixes.

Layout (`cpu_stacks`): the engine fuses q/k/v and gate/up into one matmul each, and their
LoRA A stacks are fused the same way, along the rank: one [slots, 3 * rank, in] stack per
layer for qkv, so the three projections share one gather of x, one shrink and one
index_add_ into the fused output. A is kept rank-major ([rank, in] per slot, as checkpoints hold
it), so the kernel reads only an adapter's own rank rows and never the padding up to max_rank; B
is stored transposed ([rank, out] per slot) for the same reason and because MKL's bmm reads it
faster. Why, in docs/performance.md; the measurements behind these choices, in bench/RESULTS.md
("Hot paths").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tiergate_common.env import LORA_PREFETCH, EnvError

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
    every device (`b` as transposed views); `fused_a[group]` is the storage the group's
    `a` views share, [layers, slots, projections * rank, in].
    """
    a, b, fused_a = {}, {}, {}
    for group, projs in FUSED_GROUPS.items():
        if not all(p in projections for p in projs):
            continue
        fan_in = projections[projs[0]][0]
        fused_a[group] = torch.zeros(num_layers, num_slots, len(projs) * max_rank, fan_in, dtype=dtype)
        for i, proj in enumerate(projs):
            a[proj] = fused_a[group][..., i * max_rank: (i + 1) * max_rank, :]
    for proj, (fan_in, fan_out) in projections.items():
        if proj not in a:
            a[proj] = torch.zeros(num_layers, num_slots, max_rank, fan_in, dtype=dtype)
        b[proj] = torch.zeros(num_layers, num_slots, max_rank, fan_out, dtype=dtype).transpose(-1, -2)
    return a, b, fused_a


@dataclass(frozen=True)
class LayerStacks:
    """One layer's stacks for one hook name, with their per-slot views (torch's matmul operands).

    Made once (`layer_views`): a step issues ~30 layers x 4 calls, and each view is a
    dispatcher call costing about as much as the tiny matmul it feeds.
    """

    a: torch.Tensor  # [slots, len(b) * max_rank, in]: the projections' A one after another
    b: tuple[torch.Tensor, ...]  # per projection [slots, max_rank, out_p]
    a_slot: tuple[torch.Tensor, ...]  # a[slot].T, [in, len(b) * max_rank]
    b_slot: tuple[tuple[torch.Tensor, ...], ...]  # per projection, b[p][slot]

    @classmethod
    def of(cls, a_stack: torch.Tensor, b_ts: tuple[torch.Tensor, ...]) -> LayerStacks:
        return cls(a_stack, b_ts, tuple(slot.t() for slot in a_stack.unbind(0)),
                   tuple(tuple(b_t.unbind(0)) for b_t in b_ts))


def layer_views(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], fused_a: dict[str, torch.Tensor],
                names: list[str]) -> dict[str, list[LayerStacks]]:
    """Per hook name, per layer, the `LayerStacks` of `cpu_stacks`' stacks."""
    views = {}
    for name in names:
        a_stack = fused_a[name] if name in fused_a else a[name]
        b_ts = [b[p].transpose(-1, -2) for p in projections_of(name)]
        views[name] = [LayerStacks.of(a_stack[layer], tuple(b_t[layer] for b_t in b_ts))
                       for layer in range(a_stack.shape[0])]
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
class KernelRows:
    """The step's rows with an adapter, grouped by slot for ``torch.ops.tiergate.lora_rows_``
    (engine/csrc/lora_rows.cpp): group g is slot ``slots[g]``, rows ``rows[offsets[g]:offsets[g + 1]]``."""

    slots: torch.Tensor  # int64 [groups]
    offsets: torch.Tensor  # int64 [groups + 1]
    rows: torch.Tensor  # int64
    ranks: torch.Tensor  # int64 [groups]
    scales: torch.Tensor  # float32 [groups]
    slot_set: frozenset[int]
    prefetch_to: int  # the cache level the kernel reads the stacks ahead into (prefetch_level)


@dataclass(frozen=True)
class CpuPlan:
    groups: dict[int, RowGroup]
    padded: PaddedRows | None
    kernel_rows: KernelRows | None = None


def rows_kernel() -> Callable[..., None] | None:
    """``torch.ops.tiergate.lora_rows_`` once the engine has loaded its C++ kernels (engine/cpu_build.py
    registers it from engine/csrc/lora_rows.cpp), else None. Looked up in torch's op registry rather
    than imported: lora_pool imports nothing of the engine, and without a compiler the torch path serves."""
    try:
        return torch.ops.tiergate.lora_rows_
    except (AttributeError, RuntimeError):
        return None


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


def plan_rows(row_slots: list[int], slot_info: dict[int, tuple[int, float]], kernel: bool = False,
              prefetch_to: int = 1) -> CpuPlan:
    """Group the step's rows by slot; `slot_info` maps slot -> (rank, scale). With `kernel` (`rows_kernel`
    present), every row goes to it: it beats torch's matmuls on decode rows and prefill chunks alike; it
    reads the stacks ahead into cache level `prefetch_to` (``prefetch_level``)."""
    positions: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            positions.setdefault(slot, []).append(row)
    if kernel:
        return CpuPlan({}, None, _kernel_rows(positions, slot_info, prefetch_to) if positions else None)
    small = {slot: rows for slot, rows in positions.items() if not _own_matmuls(rows)}
    if len(small) < 2:
        small = {}
    return CpuPlan(_own_groups(positions, small, slot_info), _padded(small, slot_info) if small else None)


def _own_groups(positions: dict[int, list[int]], small: dict[int, list[int]],
                slot_info: dict[int, tuple[int, float]]) -> dict[int, RowGroup]:
    groups = {}
    for slot, rows in positions.items():
        if slot not in small:
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
            groups[slot] = RowGroup(slot, index, *slot_info[slot], len(rows))
    return groups


def _kernel_rows(positions: dict[int, list[int]], slot_info: dict[int, tuple[int, float]],
                 prefetch_to: int) -> KernelRows:
    order = sorted(positions)
    offsets = [0]
    for slot in order:
        offsets.append(offsets[-1] + len(positions[slot]))
    return KernelRows(torch.tensor(order, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64),
                      torch.tensor([row for slot in order for row in positions[slot]], dtype=torch.int64),
                      torch.tensor([slot_info[slot][0] for slot in order], dtype=torch.int64),
                      torch.tensor([slot_info[slot][1] for slot in order], dtype=torch.float32), frozenset(order),
                      prefetch_to)


# Where the kernel's read-ahead pays most was measured, not derived: into L1 on a core whose L1 data
# cache holds 48 KiB (a Zen 5), into L2 on one whose L1 holds 32 KiB (a Zen 4), where asking for L1
# slowed the reads at every distance tried (bench/RESULTS.md, multi-LoRA).
L1_PREFETCH_MIN_BYTES = 48 * 1024
L1_DATA_CACHE = Path("/sys/devices/system/cpu/cpu0/cache/index0")


def prefetch_level() -> int:
    """The cache level (1 or 2) ``lora_rows_`` prefetches the adapters' stacks into: ``TIERGATE_LORA_PREFETCH``
    (``l1``, ``l2``), or with ``auto`` L1 where the core's L1 data cache holds at least 48 KiB, else L2. Read
    once per pool (``LoraPool``), not per step."""
    asked = LORA_PREFETCH.get().strip().lower()
    if asked == "auto":
        return 1 if l1_data_cache_bytes() >= L1_PREFETCH_MIN_BYTES else 2
    if asked in ("l1", "l2"):
        return int(asked[1])
    raise EnvError(f"{LORA_PREFETCH.env_name} must be auto, l1 or l2, not {asked!r}")


def l1_data_cache_bytes(cache: Path = L1_DATA_CACHE) -> int:
    """The first core's L1 data cache in bytes, from sysfs; 0 where the kernel does not say."""
    try:
        if (cache / "type").read_text().strip() != "Data" or (cache / "level").read_text().strip() != "1":
            return 0
        size = (cache / "size").read_text().strip().upper()
    except OSError:
        return 0
    units = {"K": 1024, "M": 1024 * 1024}
    try:
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except ValueError:
        return 0


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
    k = plan.kernel_rows
    if k is not None:  # the kernel's plan holds every row
        if not k.slot_set.isdisjoint(slots):
            # The b stacks are always contiguous; a is not for one projection of a fused group asked alone (a copy).
            torch.ops.tiergate.lora_rows_(x, y, stacks.a.contiguous(), stacks.b, k.slots, k.offsets, k.rows, k.ranks,
                                          k.scales, k.prefetch_to)
        return
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
        a_stack, b_ts = stacks.a, stacks.b
        if p.lo != 0 or p.hi != a_stack.shape[0]:  # a range of slots; all of them need no slicing views
            a_stack, b_ts = a_stack[p.lo: p.hi], [b_t[p.lo: p.hi] for b_t in b_ts]
        t = torch.bmm(xs, a_stack.transpose(1, 2)).mul_(p.scales)
        if len(b_ts) == 1:
            out = torch.bmm(t, b_ts[0])
        else:
            out = torch.cat([torch.bmm(t[:, :, i * max_rank: (i + 1) * max_rank], b_t) for i, b_t in enumerate(b_ts)],
                            dim=2)
        out = out.view(-1, y.shape[1])
        y.index_add_(0, p.rows, out if p.valid is None else out.index_select(0, p.valid))
