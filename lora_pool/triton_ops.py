"""Batched LoRA on CUDA: Triton shrink/expand kernels over the step's rows, in place.

Two forms, as in Punica and vLLM:
- segmented (prefill chunks): rows are grouped by slot through a sorted row index, so
  the batch itself is never reordered; each program handles BLOCK_M rows of one segment
  and runs dots over the slot's A (shrink) or B (expand) in full float32
  (input_precision="ieee", not TF32: TF32 would miss peft's output by more than the
  1e-3 the engine promises).
- gathered (decode rows): one program per row, loading that row's own slot.
The shrink accumulates in float32 and hands float32 to the expand, which adds the scaled
result into y (possibly a column slice of a fused projection output).

Tested on CPU under TRITON_INTERPRET=1 against a float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, seg, first, seg_len, BLOCK_M: tl.constexpr):
    """The rows (and their mask) of this program's BLOCK_M-row part of segment ``seg``, and its slot."""
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(rows_ptr + tl.load(seg_start_ptr + seg) + offs_m, mask=m_mask, other=0)
    return rows, m_mask, tl.load(seg_slot_ptr + seg)


@triton.jit
def _segmented_shrink(x_ptr, a_ptr, t_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                      K, R, stride_xm, stride_as, stride_ar, stride_tm,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    if first < seg_len:
        rows, m_mask, slot = _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, seg, first, seg_len, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=(offs_r[None, :] < R) & k_mask[:, None], other=0.0)
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        tl.store(t_ptr + rows[:, None] * stride_tm + offs_r[None, :], acc,
                 mask=m_mask[:, None] & (offs_r[None, :] < R))


@triton.jit
def _segmented_expand(t_ptr, b_ptr, y_ptr, scale_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                      N, R, stride_tm, stride_bs, stride_bn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    if first < seg_len:
        rows, m_mask, slot = _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, seg, first, seg_len, BLOCK_M)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        n_mask = offs_n < N
        t = tl.load(t_ptr + rows[:, None] * stride_tm + offs_r[None, :],
                    mask=m_mask[:, None] & (offs_r[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=(offs_r[:, None] < R) & n_mask[None, :], other=0.0)
        acc = tl.dot(t, b.to(tl.float32), input_precision="ieee") * tl.load(scale_ptr + slot)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gathered_shrink(x_ptr, a_ptr, t_ptr, rows_ptr, slots_ptr, K, R, stride_xm, stride_as, stride_ar,
                     stride_tm, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))
    slot = tl.load(slots_ptr + tl.program_id(0))
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=(offs_r[:, None] < R) & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + row * stride_tm + offs_r, acc, mask=offs_r < R)


@triton.jit
def _gathered_expand(t_ptr, b_ptr, y_ptr, scale_ptr, rows_ptr, slots_ptr, N, R, stride_tm, stride_bs,
                     stride_bn, stride_ym, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))
    slot = tl.load(slots_ptr + tl.program_id(0))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    t = tl.load(t_ptr + row * stride_tm + offs_r, mask=offs_r < R, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & (offs_r[None, :] < R), other=0.0).to(tl.float32)
    acc = tl.sum(b * t[None, :], axis=1) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + row * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class KernelPlan:
    """A step's row index arrays for the kernels, built once per step on the device."""

    num_rows: int
    max_rank: int
    scales: torch.Tensor  # [slots] float32
    # segmented form: rows of multi-row chunks sorted by slot, and per-segment start/length/slot
    seg_rows: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    max_seg_len: int
    # gathered form: single-row (decode) chunks, each with its slot
    gather_rows: torch.Tensor
    gather_slots: torch.Tensor

    @classmethod
    def build(cls, chunk_slots: list[tuple[int, int]], scales: torch.Tensor, max_rank: int,
              device: torch.device) -> KernelPlan:
        """`chunk_slots` lists each chunk's (slot or -1, rows) in row order."""
        by_slot: dict[int, list[int]] = {}
        gather_rows, gather_slots = [], []
        row = 0
        for slot, rows in chunk_slots:
            if slot >= 0 and rows == 1:
                gather_rows.append(row)
                gather_slots.append(slot)
            elif slot >= 0:
                by_slot.setdefault(slot, []).extend(range(row, row + rows))
            row += rows
        seg_rows, seg_start, seg_len, seg_slot = [], [], [], []
        for slot in sorted(by_slot):
            seg_start.append(len(seg_rows))
            seg_len.append(len(by_slot[slot]))
            seg_slot.append(slot)
            seg_rows.extend(by_slot[slot])

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(row, max_rank, scales.to(device), ints(seg_rows), ints(seg_start), ints(seg_len), ints(seg_slot),
                   max(seg_len, default=0), ints(gather_rows), ints(gather_slots))


def run_kernels(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: KernelPlan) -> None:
    """In place: y[row] += (x[row] @ a[slot].T) @ b[slot].T * scale[slot] for the plan's rows.

    `a` is one layer's [slots, max_rank, in] stack, `b` [slots, out, max_rank].
    """
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("LoRA kernels need unit stride along features")
    fan_in, fan_out, rank = x.shape[1], y.shape[1], plan.max_rank
    block_r = max(16, triton.next_power_of_2(rank))
    t = torch.empty(plan.num_rows, rank, dtype=torch.float32, device=x.device)
    num_segments = plan.seg_len.numel()
    if num_segments:
        block_m = 16 if plan.max_seg_len <= 16 else 32
        grid_m = triton.cdiv(plan.max_seg_len, block_m)
        _segmented_shrink[(num_segments, grid_m)](
            x, a, t, plan.seg_rows, plan.seg_start, plan.seg_len, plan.seg_slot,
            fan_in, rank, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
            BLOCK_M=block_m, BLOCK_K=64, BLOCK_R=block_r)
        _segmented_expand[(num_segments, grid_m, triton.cdiv(fan_out, 64))](
            t, b, y, plan.scales, plan.seg_rows, plan.seg_start, plan.seg_len, plan.seg_slot,
            fan_out, rank, t.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=block_r)
    num_gathered = plan.gather_rows.numel()
    if num_gathered:
        _gathered_shrink[(num_gathered,)](
            x, a, t, plan.gather_rows, plan.gather_slots, fan_in, rank,
            x.stride(0), a.stride(0), a.stride(1), t.stride(0), BLOCK_K=128, BLOCK_R=block_r)
        _gathered_expand[(num_gathered, triton.cdiv(fan_out, 64))](
            t, b, y, plan.scales, plan.gather_rows, plan.gather_slots, fan_out, rank,
            t.stride(0), b.stride(0), b.stride(1), y.stride(0), BLOCK_N=64, BLOCK_R=block_r)
