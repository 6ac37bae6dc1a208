"""The CPU causal prefill attention kernel against a float64 reference, and where the runner uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, LayerAttention, paged_attention
from engine.attention_kernels import decode_kernel_for, prefill_kernel_for


@pytest.fixture(scope="module")
def kernel():
    kernel = prefill_kernel_for("cpu", torch.float32, 64)
    assert kernel is not None, "the C++ prefill attention kernel did not build on this machine (see the log)"
    return kernel


def _chunk(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as the forward hands them over: views into one fused qkv row per token."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    kv = qkv[:, heads * head_dim :].view(tokens, 2, kv_heads, head_dim)
    return q, kv


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
               offset: int = 0) -> torch.Tensor:
    """Float64 causal attention, query i (at key position offset + i) over keys j with
    offset + i - window < j <= offset + i: ``[tokens, heads * d]``."""
    tokens, heads, _ = q.shape
    i, j = offset + torch.arange(tokens)[:, None], torch.arange(k.shape[0])[None, :]
    mask = j <= i
    if window:
        mask &= j > i - window
    group = heads // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(tokens, -1)


# (tokens, heads, kv_heads, head_dim, window): one token, lengths on and off the 16-row
# blocks, GQA and MHA, every head size family uses, windows inside and across key blocks.
CASES = [
    (1, 9, 3, 64, 0),
    (5, 4, 4, 16, 0),
    (16, 9, 3, 64, 0),
    (37, 9, 3, 64, 0),
    (37, 9, 3, 64, 7),
    (100, 6, 2, 32, 20),
    (70, 4, 1, 128, 0),
    (33, 2, 2, 256, 40),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_prefill_kernel_matches_float64_causal_attention(kernel, case, threads):
    tokens, heads, kv_heads, head_dim, window = case
    q, kv = _chunk(tokens, heads, kv_heads, head_dim, seed=tokens + head_dim)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, kv[:, 0], kv[:, 1], scale, window, 0)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (tokens, heads * head_dim)
    assert (out.double() - _reference(q, kv[:, 0], kv[:, 1], scale, window)).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [0, 5, 30])
@pytest.mark.parametrize("context", [1, 16, 45])
def test_a_later_chunk_attends_to_its_context_and_itself_as_the_reference(kernel, context, window):
    """A chunk whose queries start at key position `context` (chunked prefill, prefix-cache hit)."""
    tokens, heads, kv_heads, head_dim = 19, 9, 3, 64
    q, _ = _chunk(tokens, heads, kv_heads, head_dim, seed=context)
    _, kv = _chunk(context + tokens, heads, kv_heads, head_dim, seed=context + 1)
    out = kernel(q, kv[:, 0], kv[:, 1], 0.125, window, context)
    expected = _reference(q, kv[:, 0], kv[:, 1], 0.125, window, context)
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_prefill_kernel_applies_its_window(kernel):
    q, kv = _chunk(40, 4, 2, 16, seed=3)
    windowed = kernel(q, kv[:, 0], kv[:, 1], 0.25, 9, 0)
    full = kernel(q, kv[:, 0], kv[:, 1], 0.25, 0, 0)
    assert torch.equal(windowed[:9], full[:9])  # the first 9 positions see all their keys either way
    assert (windowed[9:] - full[9:]).abs().max().item() > 1e-3


def test_prefill_kernel_serves_only_the_shapes_it_was_written_for(kernel):
    assert prefill_kernel_for("cpu", torch.float32, 24) is None  # head_dim not a multiple of 16
    assert prefill_kernel_for("cpu", torch.float32, 512) is None
    assert prefill_kernel_for("cpu", torch.bfloat16, 64) is None
    assert prefill_kernel_for("meta", torch.float32, 64) is None
    q, kv = _chunk(8, 4, 2, 24, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(q, kv[:, 0], kv[:, 1], 0.2, 0, 0)
    q, kv = _chunk(8, 4, 2, 16, seed=1)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), kv[:, 0].double(), kv[:, 1].double(), 0.25, 0, 0)
    with pytest.raises(RuntimeError, match="query_offset"):
        kernel(q, kv[:, 0], kv[:, 1], 0.25, 0, 3)


def test_heads_larger_than_the_kernels_take_keep_the_torch_paths():
    assert decode_kernel_for("cpu", 256) is not None
    assert decode_kernel_for("cpu", 512) is None
    assert prefill_kernel_for("cpu", torch.float32, 512) is None


def test_prefill_kernel_is_off_with_the_attention_kernels_switch(monkeypatch):
    monkeypatch.setenv("TIERGATE_PAGED_ATTENTION", "off")
    assert prefill_kernel_for("cpu", torch.float32, 64) is None


@pytest.mark.parametrize("window", [None, 6])
def test_a_step_of_prompt_chunks_gives_the_kernel_what_sdpa_gives(kernel, window):
    """A chunk starting a prompt and one continuing another (8 positions already cached) in one
    step, through paged_attention with and without the kernel; with a window shorter than the
    chunks, SDPA takes its masked path and the kernel its own window."""
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    q, kv = _chunk(23, heads, kv_heads, head_dim, seed=5)
    chunks = [(0, 9, list(range(0, 3))), (8, 14, list(range(3, 9)))]
    _, cached = _chunk(8, heads, kv_heads, head_dim, seed=6)
    layer = LayerAttention(head_dim**-0.5, window)
    outs = []
    for prefill_kernel in (kernel, None):
        cache = torch.zeros(10, block_size, 2, kv_heads, head_dim)
        cache[3:5] = cached.view(2, block_size, 2, kv_heads, head_dim)
        meta = AttentionMetadata.build(chunks, block_size, "cpu", None, window, prefill_kernel)
        outs.append(paged_attention(q, kv, cache, meta, layer))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
