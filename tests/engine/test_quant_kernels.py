"""The quantized projection kernels (csrc/quant_linear.cpp via engine/quant_linear.py) against float64.

The reference is x (float64) times the weight gguf-py dequantizes from the same bytes, in
float64. The kernels quantize each row of x to int8 in blocks of 32 (scale d = max|x| / 127,
rounded half away from zero), so x_i is read as d·q_i with |x_i - d·q_i| <= d/2, and

    |y - y_ref| <= sum over blocks b of (d_b / 2) · sum_{i in b} |w_i|        (activation rounding)
                 + FLOAT_SLACK · sum_i |x_i| |w_i|                              (float32 sums)

``activation_bound`` computes this; the kernels' error is typically a tenth of it. A second,
tighter check quantizes x as the kernel does (``_as_kernel_reads``) and compares within the
float32 term alone, which a wrong nibble, scale or offset anywhere would far exceed.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights are repacked at load (csrc/quant_packed.h) and
multiplied by the packed kernels (csrc/quant_gemv*.cpp) at every row count, four rows at a time over each group
of 16 outputs (x scaled per 16 inputs for the 32-input formats); weights in the file's
layout by the scratch tiles (csrc/quant_linear.cpp).
``layout`` runs each test on both the packed and the file's layout.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import quant_linear
from engine.cpu_build import cpu_kernels_loaded
from engine.norms import add_rms_norm_
from engine.packed_linear import linear_add_rms_norm_
from engine.quant_linear import (
    AUTO_ORDER,
    ISAS,
    SERVED_TYPES,
    REPACKED_TYPES,
    QuantWeight,
    kernel_isa,
    kernel_switches,
    quant_kernels_present,
    quantize_weight,
    stack_outputs,
)
from engine.quantize import random_blocks

T = gguf.GGMLQuantizationType
TYPES = sorted(SERVED_TYPES)
# Relative float32 error allowed on sum |x||w|: products rounded once, sums of in/4 lane terms.
FLOAT_SLACK = 2e-5


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert quant_kernels_present(), "the quantized kernels did not build on this machine (see the log)"


@pytest.fixture(autouse=True)
def int8_tiles_only(monkeypatch):
    """These tests pin the int8 tiles at every row count; tests/engine/test_quant_panel.py covers the panel path."""
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", "off")


def available_isas() -> list[str]:
    """The paths this CPU runs, the one auto picks first."""
    return [isa for isa in AUTO_ORDER if torch.ops.tiergate.quant_isa_supported(ISAS.index(isa))]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Each kernel path this CPU runs, forced through TIERGATE_QUANT_ISA."""
    if request.param not in available_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv("TIERGATE_QUANT_ISA", request.param)
    return request.param


@pytest.fixture(params=["packed", "file"])
def layout(request, monkeypatch):
    """Weights built after it repacked (the default) or kept in the file's layout (TIERGATE_QUANT_REPACK=0)."""
    monkeypatch.setenv("TIERGATE_QUANT_REPACK", "1" if request.param == "packed" else "0")
    return request.param


def weight(ggml_type: T, in_features: int, out_features: int, seed: int = 0) -> QuantWeight:
    blocks = torch.from_numpy(random_blocks(ggml_type, out_features, in_features, seed=seed))
    return QuantWeight(blocks, ggml_type, in_features, out_features)


def reference_weight(w: QuantWeight) -> np.ndarray:
    """float64 ``[in, out]`` from gguf-py's dequantizer on the same bytes."""
    return gguf.quants.dequantize(w.blocks.numpy(), w.ggml_type).astype(np.float64).T


def activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    rows, in_features = x.shape
    amax = np.abs(x).reshape(rows, -1, 32).max(axis=2)  # [rows, blocks]
    w_abs = np.abs(w).reshape(-1, 32, w.shape[1]).sum(axis=1)  # [blocks, out]
    return 1.001 * (amax / 127 / 2) @ w_abs + FLOAT_SLACK * np.abs(x) @ np.abs(w)


def _as_kernel_reads(x: np.ndarray, per: int = 32) -> np.ndarray:
    """x after the kernels' int8 rounding, in float64: d = float32(max|x| / 127) per ``per`` inputs,
    q = round(x · (1/d))."""
    x32 = x.astype(np.float32).reshape(x.shape[0], -1, per)
    d = np.abs(x32).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (x32 * inv).astype(np.float64)
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), -127, 127)
    return (q * d.astype(np.float64)).reshape(x.shape)


def check_product(w: QuantWeight, x: torch.Tensor, y: torch.Tensor) -> None:
    ref = reference_weight(w)
    x64 = x.double().numpy()
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.out_features)
    y64 = y.double().numpy()
    err = np.abs(y64 - x64 @ ref)
    assert (err <= activation_bound(x64, ref)).all(), f"max error {err.max()}"
    # The packed kernels scale x per 16 inputs for the formats whose blocks are 32 inputs.
    per16 = w.packed and gguf.GGML_QUANT_SIZES[w.ggml_type][0] == 32
    xq = _as_kernel_reads(x64, 16 if per16 else 32)
    tight = np.abs(y64 - xq @ ref)
    assert (tight <= FLOAT_SLACK * (np.abs(xq) @ np.abs(ref)) + 1e-30).all(), f"max error {tight.max()}"


def shapes_for(ggml_type: T) -> list[tuple[int, int, int]]:
    """(rows, in, out): odd output counts, rows across tile edges, inputs of one to many blocks."""
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    # 576 (the bundled model's hidden size): whole 64-input chunks but not whole steps of 8 blocks.
    ins = [block, 3 * block, 576, 9 * block] if block == 32 else [256, 768]
    rows = [1, 2, 3, 4, 5, 7, 13, 33, 70]
    outs = [1, 5, 17, 61]
    return [(r, ins[i % len(ins)], outs[i % len(outs)]) for i, r in enumerate(rows)]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_kernel_matches_float64_dequantized_reference_within_activation_rounding(ggml_type, isa, layout):
    for i, (rows, in_features, out_features) in enumerate(shapes_for(ggml_type)):
        w = weight(ggml_type, in_features, out_features, seed=i)
        assert w.packed == (layout == "packed" and ggml_type in REPACKED_TYPES)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(i))
        check_product(w, x, w(x))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_kernel_reads_strided_and_transposed_x(ggml_type, isa):
    in_features = 256
    w = weight(ggml_type, in_features, 19)
    wide = torch.randn(9, in_features * 2)
    rows_strided = wide[:, 10:10 + in_features]  # rows apart by 2 * in
    transposed = torch.randn(in_features, 6).t()  # columns contiguous, rows not
    for x in (rows_strided, transposed, wide[::2, :in_features]):
        assert not x.is_contiguous()
        check_product(w, x, w(x))


def test_bfloat16_x_is_read_as_float32():
    w = weight(T.Q4_K, 256, 7)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(w(x), w(x.float()))


@pytest.mark.parametrize("rows", [1, 3, 11])
def test_stacked_weights_of_mixed_types_give_each_part_side_by_side_in_one_call(isa, rows):
    parts = [weight(T.Q4_K, 512, 40, seed=1), weight(T.Q6_K, 512, 13, seed=2), weight(T.Q8_0, 512, 24, seed=3),
             weight(T.Q5_K, 512, 3, seed=4), weight(T.Q5_0, 512, 9, seed=5), weight(T.Q5_1, 512, 6, seed=6)]
    fused = stack_outputs(parts)
    assert fused.form == "quant" and fused.in_features == 512 and fused.out_features == 95
    assert fused.nbytes == sum(p.nbytes for p in parts)
    x = torch.randn(rows, 512)
    y = fused(x)
    assert torch.equal(y, torch.cat([p(x) for p in parts], dim=1))  # each part on its own layout's kernel
    for part, piece in zip(parts, y.split([p.out_features for p in parts], dim=1)):
        check_product(part, x, piece)
    assert torch.equal(fused.dense(), torch.cat([p.dense() for p in parts], dim=1))


@pytest.mark.parametrize("rows", [1, 2, 4, 6])
def test_stacked_packed_weights_of_every_repacked_format_in_one_few_row_call(isa, rows):
    """q|k|v or gate|up of a Q4_K_M file: all parts packed, so a decode step is one packed call."""
    parts = [weight(T.Q4_K, 768, 35, seed=1), weight(T.Q6_K, 768, 16, seed=2), weight(T.Q8_0, 768, 7, seed=3),
             weight(T.Q4_0, 768, 50, seed=4)]
    assert all(p.packed for p in parts)
    fused = stack_outputs(parts)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    y = fused(x)
    for part, piece in zip(parts, y.split([p.out_features for p in parts], dim=1)):
        check_product(part, x, piece)


# (rows, in, out): row counts across the chunks of 4 and odd output counts; 8192 inputs make a
# block of rows (256 KB of int8 activations) 32 rows, so 40 rows pass over the groups twice.
MANY_ROWS = [(5, 256, 17), (8, 512, 33), (17, 768, 1), (32, 256, 61), (63, 512, 16), (100, 256, 45), (40, 8192, 19)]


@pytest.mark.parametrize("ggml_type", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_packed_kernels_at_many_rows_match_float64_dequantized_reference(ggml_type, isa):
    for i, (rows, in_features, out_features) in enumerate(MANY_ROWS):
        w = weight(ggml_type, in_features, out_features, seed=i)
        assert w.packed
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(i))
        check_product(w, x, w(x))


@pytest.mark.parametrize("ggml_type", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_each_row_of_a_many_row_call_gets_exactly_what_a_one_row_call_gives_it(ggml_type, isa):
    """The same integer sums and the same float steps per row, whatever chunk of rows it runs in."""
    for rows, in_features, out_features in [(17, 512, 35), (37, 8192, 18)]:
        w = weight(ggml_type, in_features, out_features, seed=rows)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = w(x)
        for r in range(rows):
            assert torch.equal(y[r], w(x[r:r + 1])[0]), f"row {r} of {rows}"


@pytest.fixture(params=["avx2", "avxvnni"])
def avx2_isa(request):
    """The 8-lane paths this CPU runs (an AVX-512 CPU runs the AVX2 one too)."""
    if request.param not in available_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    return request.param


def _product_on(isa: str, w: QuantWeight, x: torch.Tensor, row_prefetch: bool = True) -> torch.Tensor:
    return quant_linear.quant_matmul(x, [w], None, quant_linear.KernelSwitches(ISAS.index(isa), None, row_prefetch))


@pytest.mark.parametrize("ggml_type", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_the_avx2_paths_give_the_scalar_paths_bits(ggml_type, avx2_isa):
    """x quantized by AVX2 code and the maddubs pairs summed as int16 before widening change nothing."""
    for rows, in_features, out_features in [(1, 576, 40), (3, 1536, 17), (4, 512, 33), (9, 768, 16)]:
        in_features = in_features if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else 256 * (in_features // 256)
        w = weight(ggml_type, in_features, out_features, seed=rows)
        assert w.packed
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 4
        x[0, :7] = 0.0  # a block partly zero, and below a row whose every block is
        assert torch.equal(_product_on(avx2_isa, w, x), _product_on("scalar", w, x))


# Bytes at the start of a block that are not quantized values (the scales, and Q4_1's and Q5_1's min);
# Q6_K keeps its scale last.
_HEADER_BYTES = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 2, T.Q5_1: 4, T.Q4_K: 4}


@pytest.mark.parametrize("ggml_type", sorted(_HEADER_BYTES), ids=lambda t: t.name)
def test_int16_pair_sums_hold_at_the_largest_weights_and_activations(ggml_type, avx2_isa):
    """Every weight value at its format's largest (every quant bit set) and x at +-127 after rounding: the
    most the AVX2 path's int16 pair sums ever hold; an overflow would part them from the scalar path's int32."""
    in_features, out_features = 512, 16
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = torch.from_numpy(random_blocks(ggml_type, out_features, in_features, seed=3))
    blocks.view(out_features, -1, block_bytes)[:, :, _HEADER_BYTES[ggml_type]:] = 0xFF
    w = QuantWeight(blocks, ggml_type, in_features, out_features)
    x = torch.ones(2, in_features)
    x[1] = -1.0
    y = _product_on(avx2_isa, w, x)
    assert torch.equal(y, _product_on("scalar", w, x))
    check_product(w, x, y)


@pytest.mark.parametrize("ggml_type", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_repacking_keeps_the_file_bytes_exactly_and_only_the_packed_copy(ggml_type):
    for in_features, out_features in [(256, 1), (512, 16), (768, 45)]:
        source = torch.from_numpy(random_blocks(ggml_type, out_features, in_features, seed=out_features))
        w = QuantWeight(source.clone(), ggml_type, in_features, out_features)
        assert w.packed and w.storage.dim() == 3
        assert torch.equal(w.blocks, source)
        groups = -(-out_features // 16)
        assert w.nbytes == groups * 16 * source.shape[1]  # the file's bytes, the last group padded to 16 rows
        assert np.array_equal(w.dense().numpy(), gguf.quants.dequantize(source.numpy(), ggml_type).T)


def test_repacking_is_off_with_the_variable(monkeypatch):
    monkeypatch.setenv("TIERGATE_QUANT_REPACK", "0")
    w = weight(T.Q4_0, 64, 5)
    assert not w.packed and w.storage.dim() == 2 and w.blocks is w.storage


def test_unpacking_refuses_row_ids_out_of_range():
    w = weight(T.Q8_0, 64, 5)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tiergate.quant_unpack_rows(w.storage, int(T.Q8_0), 64, torch.tensor([16]))


def test_stack_outputs_of_one_weight_is_that_weight():
    w = weight(T.Q4_0, 64, 3)
    assert stack_outputs([w]) is w


def test_stack_outputs_refuses_parts_of_different_input_sizes():
    with pytest.raises(ValueError, match="input size"):
        stack_outputs([weight(T.Q4_0, 64, 3), weight(T.Q4_0, 96, 3)])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dense_is_exactly_gguf_py_dequantize(ggml_type):
    w = weight(ggml_type, 512, 33)
    dense = w.dense()
    assert dense.shape == (512, 33) and dense.dtype == torch.float32
    assert np.array_equal(dense.numpy(), gguf.quants.dequantize(w.blocks.numpy(), ggml_type).T)


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q5_0, T.Q6_K, T.Q4_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_dequantize_rows_gives_the_rows_a_token_embedding_looks_up(ggml_type):
    w = weight(ggml_type, 256, 50)
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]])
    rows = w.dequantize_rows(ids)
    assert rows.shape == (2, 3, 256)
    assert torch.equal(rows, w.dense().t()[ids])
    with pytest.raises(IndexError):
        w.dequantize_rows(torch.tensor([50]))


@pytest.mark.parametrize("kind,ggml_type", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0)])
def test_quantize_weight_writes_the_bytes_gguf_py_quantizer_writes(kind, ggml_type):
    w_in_out = torch.randn(320, 21, generator=torch.Generator().manual_seed(5)) * 0.05
    q = quantize_weight(w_in_out, kind)
    assert q.ggml_type == ggml_type and (q.in_features, q.out_features) == (320, 21)
    expected = gguf.quants.quantize(w_in_out.t().contiguous().numpy(), ggml_type)
    assert np.array_equal(q.blocks.numpy(), expected)
    assert np.array_equal(q.dense().numpy(), gguf.quants.dequantize(expected, ggml_type).T)


def test_quantize_weight_q4_k_round_trips_through_gguf_py_and_beats_q4_0():
    """gguf-py has no Q4_K quantizer: ours must write blocks gguf-py reads back as our dense(),
    at least as close to the float weight as Q4_0 at the same size (its point: scales and mins
    fitted per 32 values)."""
    w_in_out = torch.randn(1024, 24, generator=torch.Generator().manual_seed(6)) * 0.05
    w_in_out[:256, 0] = 0.0  # an all-zero super-block
    w_in_out[256:288, 1] = 0.25  # a constant sub-block
    q = quantize_weight(w_in_out, "q4_k")
    assert q.ggml_type == T.Q4_K and q.blocks.nbytes == 24 * 4 * 144
    back = gguf.quants.dequantize(q.blocks.numpy(), T.Q4_K).T
    assert np.array_equal(q.dense().numpy(), back)
    assert (back[:256, 0] == 0).all()
    err_k = np.sqrt(np.mean((back - w_in_out.numpy()) ** 2))
    err_0 = np.sqrt(np.mean((quantize_weight(w_in_out, "q4_0").dense().numpy() - w_in_out.numpy()) ** 2))
    assert err_k < err_0


def test_quantize_weight_refuses_unknown_kinds_and_ragged_inputs():
    with pytest.raises(ValueError, match="q5_k"):
        quantize_weight(torch.zeros(256, 4), "q5_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_weight(torch.zeros(288, 4), "q4_k")


def test_quant_weight_refuses_unserved_types_and_wrong_byte_counts():
    with pytest.raises(ValueError, match="Q2_K"):
        QuantWeight(torch.zeros(4, 84, dtype=torch.uint8), T.Q2_K, 256, 4)
    with pytest.raises(ValueError, match=r"\[4, 144\]"):
        QuantWeight(torch.zeros(4, 140, dtype=torch.uint8), T.Q4_K, 256, 4)


def test_the_kernel_runs_not_the_fallback(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dequantize-then-mm fallback ran")

    monkeypatch.setattr(quant_linear, "_fallback_matmul", refuse)
    w = weight(T.Q4_1, 64, 5)
    x = torch.randn(2, 64)
    check_product(w, x, w(x))


def test_fallback_gives_the_exact_weights_product():
    w = weight(T.Q5_K, 256, 300)  # more outputs than one fallback slice
    x = torch.randn(4, 256)
    y = quant_linear._fallback_matmul(x, [w])
    ref = x.double().numpy() @ reference_weight(w)
    assert np.allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_auto_picks_the_widest_path_and_unknown_or_unsupported_paths_are_refused(monkeypatch):
    monkeypatch.delenv("TIERGATE_QUANT_ISA", raising=False)
    assert kernel_isa() == available_isas()[0]
    monkeypatch.setenv("TIERGATE_QUANT_ISA", "neon")
    with pytest.raises(ValueError, match="TIERGATE_QUANT_ISA"):
        kernel_isa()
    monkeypatch.setenv("TIERGATE_QUANT_ISA", "scalar")
    assert kernel_isa() == "scalar"


@pytest.mark.parametrize("ggml_type", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_one_row_gets_the_same_bits_with_its_tiles_asked_for_ahead_or_not(ggml_type, isa):
    for rows, in_features, out_features in [(1, 512, 40), (1, 2048, 33), (5, 512, 17)]:
        w = weight(ggml_type, in_features, out_features, seed=in_features + rows)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(_product_on(isa, w, x, row_prefetch=True), _product_on(isa, w, x, row_prefetch=False))


def test_one_row_prefetch_is_on_for_intel_cores_and_off_for_amd_ones_unless_the_variable_says(monkeypatch, tmp_path):
    monkeypatch.delenv("TIERGATE_QUANT_ROW_PREFETCH", raising=False)
    assert quant_linear.row_prefetch() == (quant_linear.cpu_vendor() == "GenuineIntel")
    read_vendor = quant_linear.cpu_vendor.__wrapped__
    assert read_vendor(str(tmp_path / "missing")) == ""
    for vendor, expected in [("GenuineIntel", True), ("AuthenticAMD", False)]:
        cpuinfo = tmp_path / vendor
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 6\n")
        assert read_vendor(str(cpuinfo)) == vendor
        monkeypatch.setattr(quant_linear, "cpu_vendor", lambda v=vendor: v)
        assert quant_linear.row_prefetch() is expected
    for asked, expected in [("on", True), ("OFF", False)]:
        monkeypatch.setenv("TIERGATE_QUANT_ROW_PREFETCH", asked)
        assert quant_linear.row_prefetch() is expected
    monkeypatch.setenv("TIERGATE_QUANT_ROW_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match="TIERGATE_QUANT_ROW_PREFETCH must be auto, on or off"):
        quant_linear.row_prefetch()


def test_empty_x_gives_an_empty_result():
    w = weight(T.Q4_0, 64, 5)
    assert w(torch.empty(0, 64)).shape == (0, 5)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("stacked", [False, True], ids=["one", "stacked"])
def test_a_projection_added_into_the_residual_and_normed_in_one_call_gives_the_separate_calls_bits(
        isa, layout, rows, stacked):
    """linear_add_rms_norm_ on a quantized weight is one call (quant_linear_add_rms_norm_); the residual and the
    normed output are bit for bit the projection followed by add_rms_norm_, as the layer computed them before."""
    assert cpu_kernels_loaded(), "the CPU kernels did not build on this machine (see the log)"
    parts = [weight(T.Q4_K, 512, 40, seed=1)] + ([weight(T.Q8_0, 512, 24, seed=3)] if stacked else [])
    w = stack_outputs(parts)
    w.switches = kernel_switches()
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 512, generator=g), torch.randn(rows, w.out_features, generator=g)
    norm = torch.rand(w.out_features, generator=g) + 0.5
    before, expected_residual = residual.clone(), residual.clone()
    expected = add_rms_norm_(expected_residual, w(x), norm, 1e-5, fused=True)
    assert w.add_rms_norm_(x, residual.clone(), norm, 1e-5) is not None  # the one call serves here
    out = linear_add_rms_norm_(x, w, residual, norm, 1e-5)
    assert torch.equal(residual, expected_residual) and torch.equal(out, expected)
    assert not torch.equal(residual, before)


def test_the_one_call_projection_norm_leaves_what_it_does_not_serve_to_the_two_calls():
    """Switches not yet read, or a bfloat16 x: None, and linear_add_rms_norm_ makes the two calls; a residual
    whose width is not the weights' outputs is refused by the operator."""
    assert cpu_kernels_loaded(), "the CPU kernels did not build on this machine (see the log)"
    w = weight(T.Q8_0, 256, 16)
    x, residual, norm = torch.randn(2, 256), torch.randn(2, 16), torch.ones(16)
    assert w.add_rms_norm_(x, residual, norm, 1e-5) is None  # switches None: read per call, as tests flip them
    w.switches = kernel_switches()
    assert w.add_rms_norm_(x.bfloat16(), residual, norm, 1e-5) is None
    expected_residual = residual.clone()
    expected = add_rms_norm_(expected_residual, w(x.bfloat16()), norm, 1e-5, fused=True)
    assert torch.equal(linear_add_rms_norm_(x.bfloat16(), w, residual, norm, 1e-5), expected)
    with pytest.raises(RuntimeError, match="outputs"):
        w.add_rms_norm_(x, torch.randn(2, 17), torch.ones(17), 1e-5)
