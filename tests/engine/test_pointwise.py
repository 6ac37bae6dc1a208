"""The forward's fused CPU pointwise kernels (csrc/pointwise.cpp) against torch's ops in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_build import cpu_kernels_loaded
from engine.rope import apply_rope_


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert cpu_kernels_loaded(), "the CPU kernels did not build on this machine (see the log)"


def _tables(tokens: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(tokens, dim // 2, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["full", "partial"])
def test_fused_rope_rotates_strided_heads_in_place_as_torch_does(tokens, rotary_dim):
    """q and k heads as the forward passes them: a view into the fused qkv rows (and, with partial
    rotary, the first rotary_dim of each head); the values after them are left alone."""
    heads, kv_heads, head_dim = 9, 3, 64
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    cos, sin = _tables(tokens, rotary_dim, seed=tokens)
    expected = qkv.double().clone()
    view = expected[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)[..., :rotary_dim]
    apply_rope_(view, cos.double(), sin.double(), fused=False)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)[..., :rotary_dim]
    apply_rope_(qk, cos, sin, fused=True)
    assert (qkv.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fused_silu_gate_matches_torch_including_far_tails(rows):
    inter = 1536 + 5  # a tail past the last 16 lanes
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -1e30, 1e30])  # exp over- and underflow
    out = torch.ops.tiergate.silu_mul(gate_up, inter)
    wide = gate_up.double()
    expected = F.silu(wide[:, :inter]) * wide[:, inter:]
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() / expected.abs().clamp_min(1.0)).max().item() < 1e-5


def test_fused_pointwise_kernels_refuse_what_they_were_not_written_for():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tiergate.silu_mul(torch.zeros(2, 8, dtype=torch.float64), 4)
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        torch.ops.tiergate.silu_mul(torch.zeros(2, 8), 3)
    cos, sin = _tables(2, 8, seed=0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tiergate.rope_(torch.zeros(2, 1, 8, dtype=torch.float64), cos, sin)
