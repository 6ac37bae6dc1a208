"""The forward's RMSNorms (engine/norms.py): the fused CPU kernels match torch's and a float64
reference, add into the residual in place, and every input the kernels do not take goes to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.norms import add_rms_norm_, fused_norms_available, rms_norm

EPS = 1e-5


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def test_the_fused_kernels_are_built_here():
    assert fused_norms_available(torch.device("cpu"), torch.float32)
    assert not fused_norms_available(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 100), (300, 64), (2, 3)])
def test_fused_rms_norm_matches_torch_and_a_float64_reference(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, weight = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    fused, plain = rms_norm(x, weight, EPS, fused=True), rms_norm(x, weight, EPS, fused=False)
    assert (fused.double() - _reference(x, weight)).abs().max() < 1e-5
    assert torch.allclose(fused, plain, atol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 128)])
def test_add_rms_norm_adds_into_the_residual_in_place_then_norms_it(rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    residual, delta, weight = (torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen),
                               torch.randn(hidden, generator=gen))
    expected_residual = residual + delta
    fused_residual, plain_residual = residual.clone(), residual.clone()
    fused = add_rms_norm_(fused_residual, delta, weight, EPS, fused=True)
    plain = add_rms_norm_(plain_residual, delta, weight, EPS, fused=False)
    assert torch.equal(fused_residual, expected_residual) and torch.equal(plain_residual, expected_residual)
    assert (fused.double() - _reference(expected_residual, weight)).abs().max() < 1e-5
    assert torch.allclose(fused, plain, atol=1e-5)


def test_rows_with_a_stride_are_normed_in_place_and_columns_go_to_torch():
    wide, weight = torch.randn(5, 96), torch.randn(32)
    rows = wide[:, 16:48]  # rows 96 floats apart, each contiguous: the kernel reads them as they lie
    assert torch.allclose(rms_norm(rows, weight, EPS, fused=True), F.rms_norm(rows, (32,), weight, EPS), atol=1e-6)
    columns = torch.randn(32, 5).t()  # elements 5 apart: torch's path
    assert torch.allclose(rms_norm(columns, weight, EPS, fused=True), F.rms_norm(columns, (32,), weight, EPS), atol=1e-6)


def test_the_setting_turns_the_fused_kernels_off(monkeypatch):
    monkeypatch.setenv("TIERGATE_FUSED_NORMS", "0")
    assert not fused_norms_available(torch.device("cpu"), torch.float32)
