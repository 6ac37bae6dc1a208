"""bfloat16 projections with many rows on AMX (csrc/panel_linear_amx.cpp via engine/packed_linear.py).

The op reads the bfloat16 panels and x as they are, sums their products in float32 and rounds each
output once to bfloat16, as the panel kernel does; so against the float64 product of the same
bfloat16 operands it is off by the output's rounding (2^-8 of it) plus float32 summation. The op's
tests need a CPU that runs oneDNN's bfloat16 micro-kernel (AMX); the dispatch's run on any CPU,
with the op and its support stood in for.
"""

from __future__ import annotations

import pytest
import torch

from engine import packed_linear
from engine.packed_linear import AMX_MIN_ROWS, amx_min_rows, pack, panel_kernel_present

FLOAT_SLACK = 2e-5
OUTPUT_ROUNDING = 2.0 ** -8


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert panel_kernel_present(), "the CPU kernels did not build on this machine (see the log)"


def check(x: torch.Tensor, weight_in_out: torch.Tensor, y: torch.Tensor) -> None:
    x64, w64 = x.double(), weight_in_out.double()
    exact = x64 @ w64
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    err = (y.double() - exact).abs()
    bound = OUTPUT_ROUNDING * exact.abs() + FLOAT_SLACK * (x64.abs() @ w64.abs()) + 1e-30
    assert (err <= bound).all(), f"max error {err.max()}"


@pytest.mark.parametrize("rows,in_features,out_features", [(1, 64, 1), (16, 96, 17), (17, 576, 64), (33, 64, 65),
                                                           (129, 128, 130), (300, 32, 200)])
def test_amx_product_matches_float64_within_output_rounding(rows, in_features, out_features, amx_microkernel):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(in_features, out_features, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    panels = pack(w, "panels")
    check(x, w, torch.ops.tiergate.panel_linear_amx(x, panels.panels, out_features))


def test_amx_reads_strided_x_and_gives_empty_for_no_rows(amx_microkernel):
    w = (torch.randn(128, 40) * 0.05).bfloat16()
    panels = pack(w, "panels")
    x = torch.randn(50, 300).bfloat16()[:, 7:135]
    assert not x.is_contiguous()
    check(x, w, torch.ops.tiergate.panel_linear_amx(x, panels.panels, 40))
    assert torch.ops.tiergate.panel_linear_amx(torch.empty(0, 128, dtype=torch.bfloat16), panels.panels, 40).shape == (0, 40)


def test_amx_refuses_float32_x_and_mismatched_panels(amx_microkernel):
    panels = pack((torch.randn(64, 40) * 0.05).bfloat16(), "panels").panels
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tiergate.panel_linear_amx(torch.randn(20, 64), panels, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.tiergate.panel_linear_amx(torch.randn(20, 64).bfloat16(), panels, 70)


def test_many_bfloat16_rows_take_amx_and_few_the_panel_kernel(amx_microkernel, monkeypatch, fresh_row_thresholds):
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", "auto")
    w = (torch.randn(256, 48) * 0.05).bfloat16()
    weight = pack(w, "panels")
    many, few = torch.randn(AMX_MIN_ROWS, 256).bfloat16(), torch.randn(AMX_MIN_ROWS - 1, 256).bfloat16()
    assert torch.equal(weight(many), torch.ops.tiergate.panel_linear_amx(many, weight.panels, 48))
    assert torch.equal(weight(few), torch.ops.tiergate.panel_linear(few, weight.panels, 48))
    check(many, w, weight(many))


class _Spy:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x, panels, out_features):
        self.rows.append(x.shape[0])
        return torch.zeros(x.shape[0], out_features, dtype=x.dtype)


@pytest.fixture
def spies(monkeypatch, fresh_row_thresholds):
    amx_op, panel_op = _Spy(), _Spy()
    monkeypatch.setattr(torch.ops.tiergate, "panel_amx_supported", lambda: True)
    monkeypatch.setattr(torch.ops.tiergate, "panel_linear_amx", amx_op)
    monkeypatch.setattr(torch.ops.tiergate, "panel_linear", panel_op)
    return amx_op, panel_op


def test_dispatch_by_rows_and_dtype_float32_never_takes_amx(spies, monkeypatch):
    amx_op, panel_op = spies
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", "4")
    b16 = pack(torch.randn(64, 20).bfloat16(), "panels")
    f32 = pack(torch.randn(64, 20), "panels")
    b16(torch.randn(3, 64).bfloat16())
    b16(torch.randn(4, 64).bfloat16())
    f32(torch.randn(500, 64))
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", "off")
    b16(torch.randn(500, 64).bfloat16())
    assert amx_op.rows == [4]
    assert panel_op.rows == [3, 500, 500]


def test_dispatch_never_picks_amx_where_the_cpu_lacks_it(monkeypatch, fresh_row_thresholds):
    monkeypatch.setattr(torch.ops.tiergate, "panel_amx_supported", lambda: False)
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", "auto")
    assert amx_min_rows() is None
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", "8")
    with pytest.raises(ValueError, match="cannot run"):
        amx_min_rows()


@pytest.mark.parametrize("value", ["0", "-1", "lots"])
def test_bad_amx_row_counts_are_refused(value, monkeypatch, fresh_row_thresholds):
    monkeypatch.setattr(torch.ops.tiergate, "panel_amx_supported", lambda: True)
    monkeypatch.setenv("TIERGATE_BF16_AMX_ROWS", value)
    with pytest.raises(ValueError, match="TIERGATE_BF16_AMX_ROWS"):
        amx_min_rows()
