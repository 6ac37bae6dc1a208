"""The CPU batched LoRA op against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from tests.lora_pool.lora_reference import CASES, random_case, reference

from engine.cpu_build import cpu_kernels_loaded
from lora_pool import ops
from tiergate_common.env import EnvError

RANKS = [3, 8, 5]


def apply_projection(x, y, a, b, plan, slots):
    """One projection through the op: ``a`` [slots, max_rank, in], ``b`` [slots, out, max_rank], as stored."""
    ops.apply_group(x, y, ops.LayerStacks.of(a, (b.transpose(1, 2),)), plan, slots)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_op_matches_float64_reference(case):
    chunks = CASES[case]
    x, y, a, b, scales = random_case(chunks, fan_in=24, fan_out=40, ranks=RANKS, max_rank=8)
    row_slots = [s for s, n in chunks for _ in range(n)]
    expected = reference(x, y, a, b, scales, row_slots, RANKS)
    plan = ops.plan_rows(row_slots, {s: (RANKS[s], float(scales[s])) for s in range(3)})
    apply_projection(x, y, a, b, plan, [0, 1, 2])
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_cpu_op_writes_into_a_column_slice_of_a_fused_output():
    chunks = CASES["mixed"]
    x, y, a, b, scales = random_case(chunks, fan_in=24, fan_out=40, ranks=RANKS, max_rank=8)
    row_slots = [s for s, n in chunks for _ in range(n)]
    fused = torch.zeros(y.shape[0], 100)
    fused[:, 30:70] = y
    plan = ops.plan_rows(row_slots, {s: (RANKS[s], float(scales[s])) for s in range(3)})
    apply_projection(x, fused[:, 30:70], a, b, plan, [0, 1, 2])
    torch.testing.assert_close(fused[:, 30:70].double(), reference(x, y, a, b, scales, row_slots, RANKS),
                               rtol=1e-5, atol=1e-4)
    assert fused[:, :30].abs().sum() == 0 and fused[:, 70:].abs().sum() == 0


def test_rows_without_adapter_are_untouched():
    chunks = [(-1, 3), (0, 2), (-1, 2)]
    x, y, a, b, scales = random_case(chunks, fan_in=8, fan_out=8, ranks=[4], max_rank=4)
    before = y.clone()
    plan = ops.plan_rows([s for s, n in chunks for _ in range(n)], {0: (4, 1.0)})
    apply_projection(x, y, a, b, plan, [0])
    assert torch.equal(y[:3], before[:3]) and torch.equal(y[5:], before[5:])
    assert not torch.equal(y[3:5], before[3:5])


def test_long_runs_get_their_own_matmuls_and_the_rest_share_a_padded_bmm():
    info = {0: (3, 1.0), 1: (8, 1.0), 2: (5, 1.0)}
    plan = ops.plan_rows([2] * 9 + [0, -1, 1, 1, 0], info)  # a prefill chunk of 9 rows, then decodes
    assert set(plan.groups) == {2} and plan.padded.slots == {0, 1}
    interleaved = ops.plan_rows([0, 1, 2] * 10, info)  # ten decodes per adapter, scattered
    assert interleaved.groups == {} and interleaved.padded.slots == {0, 1, 2}
    assert ops.plan_rows([0, 0, -1], {0: (3, 1.0)}).padded is None  # one adapter: a plain matmul pair



@pytest.fixture(scope="module")
def rows_kernel():
    """torch.ops.tiergate.lora_rows_, built with the engine's other C++ kernels."""
    assert cpu_kernels_loaded(), "the CPU kernels did not build on this machine (see the log)"
    assert ops.rows_kernel() is not None
    return ops.rows_kernel()


@pytest.mark.parametrize("kernel, stack_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["torch", "kernel", "kernel_bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_group_in_the_cpu_layout_matches_each_projection_reference(case, kernel, stack_dtype, request):
    """A qkv-like group (three projections of different widths sharing x) through one
    apply_group call over cpu_stacks' fused stacks, as LoraBatch runs it: on torch's
    ops, or every row on the C++ kernel (lora_rows_), over float32 stacks or bfloat16 ones (against
    the reference of the weights rounded to bfloat16: the kernel adds no rounding of its own)."""
    if kernel:
        request.getfixturevalue("rows_kernel")
    chunks = CASES[case]
    row_slots = [s for s, n in chunks for _ in range(n)]
    widths = {"q": 40, "k": 16, "v": 19}  # v: a width no vector divides
    projections = {**{p: (24, w) for p, w in widths.items()}, "o": (40, 24), "gate": (24, 32), "up": (24, 32),
                   "down": (32, 24)}
    a, b, fused_a = ops.cpu_stacks(projections, num_layers=2, num_slots=3, max_rank=8, dtype=stack_dtype)
    x, _, _, _, scales = random_case(chunks, fan_in=24, fan_out=1, ranks=RANKS, max_rank=8)
    expected, ys = [], []
    for seed, (proj, width) in enumerate(widths.items(), start=1):
        _, y, a_p, b_p, _ = random_case(chunks, fan_in=24, fan_out=width, ranks=RANKS, max_rank=8, seed=seed)
        a_p, b_p = a_p.to(stack_dtype).float(), b_p.to(stack_dtype).float()
        a[proj][1].copy_(a_p)
        b[proj][1].copy_(b_p)
        expected.append(reference(x, y, a_p, b_p, scales, row_slots, RANKS))
        ys.append(y)
    y = torch.cat(ys, dim=1)
    plan = ops.plan_rows(row_slots, {s: (RANKS[s], float(scales[s])) for s in range(3)}, kernel=kernel)
    assert (plan.kernel_rows is not None) == kernel and (not kernel or plan.groups == {})
    stacks = ops.layer_views(a, b, fused_a, ["qkv"])["qkv"][1]
    assert stacks.a.data_ptr() == fused_a["qkv"][1].data_ptr()  # the three A stacks are one tensor
    ops.apply_group(x, y, stacks, plan, [0, 1, 2])
    torch.testing.assert_close(y.double(), torch.cat(expected, dim=1), rtol=1e-5, atol=1e-4)


def test_the_kernel_takes_every_row_with_an_adapter_grouped_by_slot_and_the_torch_path_splits_them():
    info = {0: (3, 1.0), 1: (8, 0.5), 2: (5, 1.0)}
    row_slots = [2] * 9 + [0, -1, 1, 1, 0]
    plan = ops.plan_rows(row_slots, info, kernel=True)
    assert plan.groups == {} and plan.padded is None
    k = plan.kernel_rows
    assert k.slots.tolist() == [0, 1, 2] and k.offsets.tolist() == [0, 2, 4, 13]
    assert k.rows.tolist() == [9, 13, 11, 12, *range(9)]
    assert k.ranks.tolist() == [3, 8, 5] and k.scales.tolist() == [1.0, 0.5, 1.0]
    assert ops.plan_rows([-1, -1], info, kernel=True).kernel_rows is None
    # Without the kernel the long run gets its own matmuls and the few-row adapters share a padded bmm.
    torch_plan = ops.plan_rows(row_slots, info)
    assert set(torch_plan.groups) == {2} and torch_plan.padded.slots == {0, 1} and torch_plan.kernel_rows is None


def test_the_kernel_refuses_stacks_of_the_wrong_shape_without_touching_y(rows_kernel):
    x, y = torch.randn(2, 8), torch.zeros(2, 6)
    a, b = torch.zeros(1, 4, 8), [torch.zeros(1, 4, 5)]  # rank-major a; b's 5 columns, y's 6
    k = ops.plan_rows([0, 0], {0: (4, 1.0)}, kernel=True).kernel_rows
    with pytest.raises(RuntimeError, match="columns"):
        rows_kernel(x, y, a, b, k.slots, k.offsets, k.rows, k.ranks, k.scales, 1)
    with pytest.raises(RuntimeError, match="out of range"):
        rows_kernel(x, torch.zeros(2, 5), a, b, torch.tensor([3]), k.offsets, k.rows, k.ranks, k.scales, 1)
    with pytest.raises(RuntimeError, match="listed twice"):  # two threads would add into one row at once
        rows_kernel(x, torch.zeros(2, 5), a, b, k.slots, k.offsets, torch.tensor([1, 1]), k.ranks, k.scales, 1)
    with pytest.raises(RuntimeError, match="dtype"):
        rows_kernel(x, torch.zeros(2, 5), a.bfloat16(), b, k.slots, k.offsets, k.rows, k.ranks, k.scales, 1)
    assert y.abs().sum() == 0


def test_the_kernel_sums_the_same_whichever_cache_level_it_reads_ahead_into(rows_kernel):
    """The read-ahead's level (prefetch_level) changes only where the stacks wait to be read: the sums are
    equal bit for bit, over enough slots and rows that the read-ahead crosses from slot to slot."""
    gen = torch.Generator().manual_seed(7)
    slots, max_rank, fan_in, widths = 6, 16, 200, (96, 40)
    a = torch.randn(slots, len(widths) * max_rank, fan_in, generator=gen).bfloat16()
    b = [torch.randn(slots, max_rank, w, generator=gen).bfloat16() for w in widths]
    row_slots = [s for s in range(slots) for _ in range(1 + s % 3)] + [-1, 2]
    x = torch.randn(len(row_slots), fan_in, generator=gen)
    info = {s: (8 if s % 2 else 16, 0.5 + s) for s in range(slots)}
    k = ops.plan_rows(row_slots, info, kernel=True).kernel_rows
    ys = {}
    for level in (1, 2):
        ys[level] = torch.randn(len(row_slots), sum(widths), generator=torch.Generator().manual_seed(3))
        rows_kernel(x, ys[level], a, b, k.slots, k.offsets, k.rows, k.ranks, k.scales, level)
    assert torch.equal(ys[1], ys[2])
    with pytest.raises(RuntimeError, match="prefetch_to"):
        rows_kernel(x, ys[1], a, b, k.slots, k.offsets, k.rows, k.ranks, k.scales, 3)


def test_the_kernel_sums_the_same_however_many_threads_share_slots_of_uneven_ranks(rows_kernel):
    """The threads take runs of slots of about equal work (ranks times rows), not equal counts: the small ranks
    first and the large last, every row still gets the same sums bit for bit on 1 to 5 threads, and the reference's."""
    gen = torch.Generator().manual_seed(11)
    slots, max_rank, fan_in, widths = 9, 16, 64, (48, 24)
    ranks = [2, 2, 2, 4, 4, 8, 16, 16, 16]
    a = torch.randn(slots, len(widths) * max_rank, fan_in, generator=gen)
    b = [torch.randn(slots, max_rank, w, generator=gen) for w in widths]
    row_slots = [s for s in range(slots) for _ in range(1 + (s * 5) % 7)]
    x = torch.randn(len(row_slots), fan_in, generator=gen)
    scales = {s: 0.25 + s for s in range(slots)}
    k = ops.plan_rows(row_slots, {s: (ranks[s], scales[s]) for s in range(slots)}, kernel=True).kernel_rows
    expected = torch.zeros(len(row_slots), sum(widths), dtype=torch.float64)
    for row, s in enumerate(row_slots):
        for p, w in enumerate(widths):
            a_p = a[s, p * max_rank:p * max_rank + ranks[s]].double()
            shrunk = a_p @ x[row].double()
            column = sum(widths[:p])
            expected[row, column:column + w] = scales[s] * (b[p][s, :ranks[s]].double().T @ shrunk)
    ys = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            ys[threads] = torch.zeros(len(row_slots), sum(widths))
            rows_kernel(x, ys[threads], a, b, k.slots, k.offsets, k.rows, k.ranks, k.scales, 2)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(ys[1], y) for y in ys.values())
    torch.testing.assert_close(ys[1].double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("l1_bytes, level", [(48 * 1024, 1), (64 * 1024, 1), (32 * 1024, 2), (0, 2)])
def test_auto_reads_ahead_into_l1_only_where_the_l1_data_cache_holds_48_kib(monkeypatch,
                                                                              l1_bytes, level):
    monkeypatch.delenv("TIERGATE_LORA_PREFETCH", raising=False)
    monkeypatch.setattr(ops, "l1_data_cache_bytes", lambda: l1_bytes)
    assert ops.prefetch_level() == level
    assert ops.plan_rows([0], {0: (4, 1.0)}, kernel=True, prefetch_to=level).kernel_rows.prefetch_to == level


def test_the_variable_picks_the_level_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setattr(ops, "l1_data_cache_bytes", lambda: 32 * 1024)
    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "L1")
    assert ops.prefetch_level() == 1
    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "l2")
    assert ops.prefetch_level() == 2
    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "l3")
    with pytest.raises(EnvError, match="TIERGATE_LORA_PREFETCH must be auto, l1 or l2"):
        ops.prefetch_level()


@pytest.mark.parametrize("files, expected", [
    ({"level": "1", "type": "Data", "size": "48K"}, 48 * 1024),
    ({"level": "1", "type": "Data", "size": "32768"}, 32768),
    ({"level": "1", "type": "Instruction", "size": "32K"}, 0),  # not the data cache: say nothing
    ({"level": "1", "type": "Data", "size": "big"}, 0),
    ({}, 0),  # no sysfs entry (a container without it)
])
def test_the_l1_data_cache_is_read_from_sysfs_and_unknown_is_zero(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    assert ops.l1_data_cache_bytes(tmp_path) == expected
