"""The many-row panel path of the quantized projections (csrc/quant_dequant_panel.cpp via engine/quant_linear.py).

The op decodes each weight exactly and rounds it once to bfloat16, rounds x once to bfloat16, and
sums the products in float32 on oneDNN's micro-kernel. So against float64:

- the decoded panel equals gguf-py's dequantized weight rounded to bfloat16, exactly;
- the product equals (x in bfloat16) times (that panel) in float64 within float32 summation;
- and the exact product within the two roundings: |x - x16| <= 2^-8 |x|, |w - w16| <= 2^-8 |w| (8 significant bits, rounded to nearest).

The op's tests need a CPU that runs oneDNN's bfloat16 micro-kernel (AMX); the dispatch's tests
run on any CPU, with the op's support and the op itself stood in for.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import quant_linear
from engine.quant_linear import SERVED_TYPES, QuantWeight, panel_min_rows, quant_kernels_present, stack_outputs
from engine.quantize import random_blocks

T = gguf.GGMLQuantizationType
TYPES = sorted(SERVED_TYPES)
FLOAT_SLACK = 2e-5  # float32 sums of in-long products, relative to sum |x||w|
BF16_ROUNDING = 2.0 ** -7 + 2.0 ** -16  # (1 + 2^-8)^2 - 1: x and w each rounded once


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert quant_kernels_present(), "the quantized kernels did not build on this machine (see the log)"


def weight(ggml_type: T, in_features: int, out_features: int, seed: int = 0) -> QuantWeight:
    blocks = torch.from_numpy(random_blocks(ggml_type, out_features, in_features, seed=seed))
    return QuantWeight(blocks, ggml_type, in_features, out_features)


def reference_rows(w: QuantWeight) -> np.ndarray:
    """float64 ``[out, in]``: gguf-py's dequantizer on the same bytes."""
    return gguf.quants.dequantize(w.blocks.numpy(), w.ggml_type).astype(np.float64)


def panel_product(x: torch.Tensor, parts: list[QuantWeight]) -> torch.Tensor:
    """The op on the weights as served: repacked for the decode kernels where their format is, else the file's rows."""
    return torch.ops.tiergate.quant_panel_linear(x, [p.storage for p in parts], [int(p.ggml_type) for p in parts],
                                                 [p.out_features for p in parts])


def int8_tiles(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The int8 kernels on the weight as served (repacked where its format is): what the dispatch runs below the
    panel path's threshold."""
    return torch.ops.tiergate.quant_linear(x, [w.storage], [int(w.ggml_type)], [w.out_features],
                                           quant_linear.ISAS.index(quant_linear.kernel_isa()), quant_linear.row_prefetch())


def check_product(w_rows: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` against x @ w_rows^T (float64) within the path's two roundings, and against the bfloat16 operands'
    product within float32 summation."""
    x64 = x.double().numpy()
    x16 = x.bfloat16().double().numpy()
    w16 = torch.from_numpy(w_rows).float().bfloat16().double().numpy()
    y64 = y.double().numpy()
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w_rows.shape[0])
    magnitude = np.abs(x64) @ np.abs(w_rows).T
    exact_err = np.abs(y64 - x64 @ w_rows.T)
    assert (exact_err <= (BF16_ROUNDING + FLOAT_SLACK) * magnitude + 1e-30).all(), f"max error {exact_err.max()}"
    tight = np.abs(y64 - x16 @ w16.T)
    assert (tight <= FLOAT_SLACK * (np.abs(x16) @ np.abs(w16).T) + 1e-30).all(), f"max error {tight.max()}"


def shapes_for(ggml_type: T) -> list[tuple[int, int, int]]:
    """(rows, in, out): rows across the 16-row packing unit and the 64-row blocks of x, outputs across
    the 64-output panels, inputs of one to many blocks."""
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    ins = [block, 3 * block, 576, 9 * block] if block == 32 else [256, 768]
    rows = [1, 5, 16, 17, 33, 64, 70, 130]
    outs = [1, 17, 64, 65, 130]
    return [(r, ins[i % len(ins)], outs[i % len(outs)]) for i, r in enumerate(rows)]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_decoded_panel_is_the_float64_reference_rounded_once_to_bfloat16(ggml_type, amx_microkernel):
    for i, (_, in_features, out_features) in enumerate(shapes_for(ggml_type)):
        w = weight(ggml_type, in_features, out_features, seed=i)
        ref = reference_rows(w)
        got = torch.ops.tiergate.quant_dequantize_bf16(w.blocks, int(ggml_type), in_features)
        assert got.dtype == torch.bfloat16 and got.shape == (out_features, in_features)
        assert torch.equal(got, torch.from_numpy(ref).float().bfloat16())
        assert (np.abs(got.double().numpy() - ref) <= 2.0 ** -8 * np.abs(ref)).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_panel_product_matches_float64_reference_within_bfloat16_rounding(ggml_type, amx_microkernel):
    for i, (rows, in_features, out_features) in enumerate(shapes_for(ggml_type)):
        w = weight(ggml_type, in_features, out_features, seed=i)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(i))
        check_product(reference_rows(w), x, panel_product(x, [w]))


def test_panel_product_of_stacked_mixed_types_gives_each_part_side_by_side(amx_microkernel):
    parts = [weight(T.Q4_K, 512, 70, seed=1), weight(T.Q6_K, 512, 13, seed=2), weight(T.Q8_0, 512, 64, seed=3),
             weight(T.Q5_K, 512, 3, seed=4), weight(T.Q4_0, 512, 9, seed=5), weight(T.Q5_1, 512, 6, seed=6)]
    x = torch.randn(37, 512)
    check_product(np.concatenate([reference_rows(p) for p in parts]), x, panel_product(x, parts))


@pytest.mark.parametrize("ggml_type", sorted(quant_linear.REPACKED_TYPES), ids=lambda t: t.name)
def test_panel_product_of_a_repacked_weight_equals_its_file_layouts(ggml_type, amx_microkernel):
    """A weight repacked at load (csrc/quant_packed.h's 16-row groups) decodes to the same panel values."""
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    w = weight(ggml_type, 2 * block if block == 256 else 5 * block, 83, seed=7)
    assert w.storage.dim() == 3, "the format is repacked at load"
    x = torch.randn(70, w.in_features, generator=torch.Generator().manual_seed(3))
    from_file = torch.ops.tiergate.quant_panel_linear(x, [w.blocks], [int(ggml_type)], [w.out_features])
    assert torch.equal(panel_product(x, [w]), from_file)


def test_panel_product_reads_strided_x_and_gives_empty_for_no_rows(amx_microkernel):
    w = weight(T.Q4_0, 256, 19)
    wide = torch.randn(40, 512)
    x = wide[:, 100:356]
    assert not x.is_contiguous()
    check_product(reference_rows(w), x, panel_product(x, [w]))
    assert panel_product(torch.empty(0, 256), [w]).shape == (0, 19)


def test_panel_product_refuses_mismatched_blocks(amx_microkernel):
    w = weight(T.Q4_K, 256, 5)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.tiergate.quant_panel_linear(torch.randn(20, 512), [w.blocks], [int(T.Q4_K)], [5])


def test_many_rows_take_the_panel_path_and_few_rows_the_int8_tiles(amx_microkernel, monkeypatch, fresh_row_thresholds):
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "8")
    w = weight(T.Q4_1, 256, 33)
    many, few = torch.randn(8, 256), torch.randn(7, 256)
    assert torch.equal(w(many), panel_product(many, [w]))
    assert torch.equal(w(few), int8_tiles(few, w))
    check_product(reference_rows(w), many, w(many))


class _Spy:
    """Stands in for an op: records the row counts it was called with and returns zeros of the right shape."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x, blocks, types, out_features, *isa):
        self.rows.append(x.shape[0])
        return torch.zeros(x.shape[0], sum(out_features))


@pytest.fixture
def spies(monkeypatch, fresh_row_thresholds):
    """Both ops spied on, the panel path made available: the dispatch tested on any CPU."""
    panel, tiles = _Spy(), _Spy()
    monkeypatch.setattr(torch.ops.tiergate, "quant_panel_supported", lambda: True)
    monkeypatch.setattr(torch.ops.tiergate, "quant_panel_linear", panel)
    monkeypatch.setattr(torch.ops.tiergate, "quant_linear", tiles)
    return panel, tiles


def test_dispatch_sends_rows_from_the_threshold_on_to_the_panels(spies, monkeypatch):
    panel, tiles = spies
    w = stack_outputs([weight(T.Q8_0, 64, 5), weight(T.Q4_1, 64, 3)])
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "auto")
    for rows in (1, quant_linear.PANEL_MIN_ROWS - 1, quant_linear.PANEL_MIN_ROWS, 512):
        w(torch.randn(rows, 64))
    assert tiles.rows == [1, quant_linear.PANEL_MIN_ROWS - 1]
    assert panel.rows == [quant_linear.PANEL_MIN_ROWS, 512]


def test_dispatch_threshold_is_set_by_the_variable_and_off_keeps_the_int8_tiles(spies, monkeypatch):
    panel, tiles = spies
    w = weight(T.Q4_0, 64, 5)
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "3")
    w(torch.randn(2, 64))
    w(torch.randn(3, 64))
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "off")
    w(torch.randn(600, 64))
    assert panel.rows == [3] and tiles.rows == [2, 600]


def test_dispatch_never_picks_the_panels_where_the_cpu_lacks_them(monkeypatch, fresh_row_thresholds):
    monkeypatch.setattr(torch.ops.tiergate, "quant_panel_supported", lambda: False)
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "auto")
    assert panel_min_rows() is None
    w = weight(T.Q4_0, 64, 5)
    x = torch.randn(100, 64)
    assert torch.equal(w(x), int8_tiles(x, w))
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "4")
    with pytest.raises(ValueError, match="cannot run"):
        panel_min_rows()


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_bad_threshold_values_are_refused(value, monkeypatch, fresh_row_thresholds):
    monkeypatch.setattr(torch.ops.tiergate, "quant_panel_supported", lambda: True)
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", value)
    with pytest.raises(ValueError, match="TIERGATE_QUANT_PANEL_ROWS"):
        panel_min_rows()
