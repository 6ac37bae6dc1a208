"""The CPU paged decode attention kernel against a float64 reference, and the gathered fallback on its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.attention import (DECODE_ROWS_PER_CHUNK, AttentionMetadata, LayerAttention, paged_attention,
                              rope_decode_attention)
from engine.attention_kernels import cpu_decode_kernel
from engine.rope import apply_rope_
from tests.engine.paged_attention_reference import CASES, VARIANTS, DecodeCase, random_case, reference, variant_case

HERE = Path(__file__).parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def kernel():
    kernel = cpu_decode_kernel()
    assert kernel is not None, "the C++ paged attention kernel did not build on this machine (see the log)"
    return kernel


def on_threads(threads: int, kernel, data) -> torch.Tensor:
    """The kernel's output for ``data`` (its window and soft-cap included) on ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel(data.q, data.kv_cache, data.block_tables, data.context_lens, data.scale, data.window, data.softcap)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_matches_float64_reference(kernel, case, threads):
    lens, heads, kv_heads, head_dim, block_size = CASES[case]
    data = random_case(lens, heads, kv_heads, head_dim, block_size, seed=len(case))
    out = on_threads(threads, kernel, data)
    assert out.shape == (len(lens), heads * head_dim) and out.dtype == torch.float32
    assert (out.double() - reference(data)).abs().max().item() < 1e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cpu_kernel_applies_sliding_windows_and_soft_caps_as_the_reference(kernel, variant, threads):
    data = variant_case(variant)
    out = on_threads(threads, kernel, data)
    assert (out.double() - reference(data)).abs().max().item() < 1e-5
    # Without them the output differs, so the comparison above can fail.
    plain = kernel(data.q, data.kv_cache, data.block_tables, data.context_lens, data.scale)
    assert (plain.double() - reference(data)).abs().max().item() > 1e-3


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (100, 0.0), (30, 2.0)])
@pytest.mark.parametrize("lens", [[700], [1, 250, 700], [40, 17], [900] + [60] * 7],
                         ids=["one_long", "three_uneven", "two_short", "one_long_among_short"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["float32", "bfloat16"])
def test_contexts_split_between_threads_join_into_one_softmax(kernel, lens, window, softcap, threads, dtype, tolerance):
    """Where a call's sequences (or one sequence's KV heads) do not share out evenly over the threads, or one
    context holds more than a thread's share, contexts are cut into parts attended apart and joined after (in
    float32, whatever the cache's dtype): the same attention as the reference."""
    data = random_case(lens, 9, 3, 64, 16, dtype=dtype, seed=threads, window=window, softcap=softcap)
    out = on_threads(threads, kernel, data)
    assert out.dtype == dtype
    assert (out.double() - reference(data)).abs().max().item() < tolerance


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "gathered"])
def test_windowed_soft_capped_decode_through_the_step_matches_reference(variant, with_kernel, kernel):
    """The windowed metadata and the soft-capped eager path agree with the kernel and the reference."""
    data = variant_case(variant)
    lens = data.context_lens.tolist()
    block_size, head_dim = data.kv_cache.shape[1], data.q.shape[-1]
    chunks = [(n - 1, 1, data.block_tables[i].tolist()) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build(chunks, block_size, "cpu", kernel if with_kernel else None, data.window or None)
    layer = LayerAttention(head_dim**-0.5, data.window or None, data.softcap or None)
    last = [int(data.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    new_kv = data.kv_cache.reshape(-1, 2, *data.kv_cache.shape[3:])[last].clone()
    out = paged_attention(data.q, new_kv, data.kv_cache, meta, layer)
    assert (out.double() - reference(data)).abs().max().item() < 1e-5


def test_cpu_kernel_accumulates_bfloat16_caches_in_float32(kernel):
    lens, heads, kv_heads, head_dim, block_size = CASES["smollm2_gqa"]
    data = random_case(lens, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
    out = kernel(data.q, data.kv_cache, data.block_tables, data.context_lens, data.scale)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of the output: anything coarser would mean bf16 accumulation.
    assert (out.double() - reference(data)).abs().max().item() < 1e-2


def test_cpu_kernel_refuses_mismatched_inputs(kernel):
    data = random_case([5], 4, 2, 16, 4)
    with pytest.raises(RuntimeError, match="one row per query"):
        kernel(data.q, data.kv_cache, data.block_tables, torch.tensor([5, 5]), data.scale)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(data.q, data.kv_cache, data.block_tables.int(), data.context_lens, data.scale)


def _decode_metadata(lens: list[int], tables: torch.Tensor, block_size: int, kernel) -> AttentionMetadata:
    """Metadata for a step of decodes only: row i is position lens[i] - 1 of sequence i."""
    chunks = [(n - 1, 1, tables[i].tolist()) for i, n in enumerate(lens)]
    return AttentionMetadata.build(chunks, block_size, "cpu", decode_kernel=kernel)


@pytest.mark.parametrize("case", ["smollm2_gqa", "odd_block_size", "single_sequence"])
@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "gathered"])
def test_decode_attention_through_the_step_matches_reference(case, with_kernel, kernel):
    """paged_attention writes the step's K/V, then attends: the kernel and the fallback both match."""
    lens, heads, kv_heads, head_dim, block_size = CASES[case]
    data = random_case(lens, heads, kv_heads, head_dim, block_size, seed=3)
    meta = _decode_metadata(lens, data.block_tables, block_size, kernel if with_kernel else None)
    assert (meta.decode.mask is None) == (with_kernel or len(lens) == 1)
    # This step's K/V: the last position of each context, written by paged_attention itself.
    last = [int(data.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    new_kv = data.kv_cache.reshape(-1, 2, kv_heads, head_dim)[last].clone()
    data.kv_cache.reshape(-1, 2, kv_heads, head_dim)[last] = 0.0
    out = paged_attention(data.q, new_kv, data.kv_cache, meta, LayerAttention(head_dim**-0.5))
    assert (out.double() - reference(data)).abs().max().item() < 1e-5


def test_kernels_that_cannot_build_leave_the_gathered_path_and_onednn_and_warn_once(tmp_path):
    """No compiler: the engine logs one warning, decodes through the gathered path and packs its
    projections for oneDNN instead of the panel kernel."""
    script = textwrap.dedent("""
        import logging
        import torch
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
        from engine.packed_linear import weight_form
        from engine.attention_kernels import decode_kernel_for
        assert decode_kernel_for("cpu") is None
        assert decode_kernel_for("cpu") is None
        assert weight_form("cpu", torch.float32) == "onednn"
        print("fallback ok")
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "fallback ok" in run.stdout
    warnings = [line for line in run.stderr.splitlines() if "CPU kernels unavailable" in line]
    assert len(warnings) == 1, run.stderr


def test_paged_attention_off_keeps_the_gathered_path(monkeypatch):
    from engine.attention_kernels import decode_kernel_for

    monkeypatch.setenv("TIERGATE_PAGED_ATTENTION", "off")
    assert decode_kernel_for("cpu") is None


def _rope_tables(tokens: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[tokens, 1, head_dim]``, as engine/rope.py's ``Rope.tables`` builds them."""
    angles = torch.rand(tokens, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.28
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["smollm2_gqa", "odd_block_size", "single_sequence", "mha",
                                  "window_across_blocks", "window_and_softcap"])
def test_rope_decode_attention_rotates_writes_and_attends_as_the_separate_calls_do(kernel, case, threads):
    """The one-call decode path (attention.rope_decode_attention) against what it replaces: qkv's query and
    key heads rotated in place, the values left, each row's keys and values in its slot and nothing else
    in the pool changed, and the attention over that pool equal to the float64 reference."""
    if case in VARIANTS:
        data = variant_case(case)
    else:
        lens, heads, kv_heads, head_dim, block_size = CASES[case]
        data = random_case(lens, heads, kv_heads, head_dim, block_size, seed=5)
    batch, heads, head_dim = data.q.shape
    kv_heads, block_size = data.kv_cache.shape[3], data.kv_cache.shape[1]
    lens = data.context_lens.tolist()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(7))
    cos, sin = _rope_tables(batch, head_dim, seed=len(case))
    expected_qkv = qkv.double().clone()
    apply_rope_(expected_qkv[:, : (heads + kv_heads) * head_dim].view(batch, heads + kv_heads, head_dim),
                cos.double(), sin.double())
    slots = [int(data.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for i, n in enumerate(lens)]
    expected_cache = data.kv_cache.double().clone()
    expected_cache.view(-1, 2 * kv_heads * head_dim)[slots] = expected_qkv[:, heads * head_dim:]
    expected = reference(DecodeCase(expected_qkv[:, : heads * head_dim].view(batch, heads, head_dim), expected_cache,
                                    data.block_tables, data.context_lens, data.window, data.softcap))

    chunks = [(n - 1, 1, data.block_tables[i].tolist()) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build(chunks, block_size, "cpu", kernel, data.window or None)
    assert meta.decode_only
    layer = LayerAttention(head_dim**-0.5, data.window or None, data.softcap or None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = rope_decode_attention(qkv, cos, sin, data.kv_cache, meta, layer, heads)
    finally:
        torch.set_num_threads(before)
    assert (qkv.double() - expected_qkv).abs().max().item() < 1e-5
    assert (data.kv_cache.double() - expected_cache).abs().max().item() < 1e-5
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_rope_decode_attention_refuses_slots_outside_the_pool_and_other_dtypes(kernel):
    data = random_case([5], 4, 2, 16, 4)
    qkv = torch.randn(1, (4 + 2 * 2) * 16)
    cos, sin = _rope_tables(1, 16, seed=0)
    call = torch.ops.tiergate.rope_decode_attention
    with pytest.raises(RuntimeError, match="outside the pool"):
        call(qkv, cos, sin, data.kv_cache, torch.tensor([data.kv_cache.shape[0] * 4]), data.block_tables,
             data.context_lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        call(qkv.double(), cos, sin, data.kv_cache, torch.tensor([0]), data.block_tables, data.context_lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="heads \\+ 2 \\* kv_heads"):
        call(qkv[:, :-16], cos, sin, data.kv_cache, torch.tensor([0]), data.block_tables, data.context_lens, 4, 0.25)


@pytest.mark.parametrize("variant", ["plain", "window_across_blocks", "window_and_softcap"])
def test_a_chunk_of_a_few_tokens_attends_as_decode_rows_each_over_its_own_prefix(kernel, variant):
    """Drafts to verify, or a short prompt's last piece: a chunk of up to DECODE_ROWS_PER_CHUNK tokens is that many
    decode rows on the paged kernel, query p attending to positions [0, p] as the float64 reference does (its own
    keys and values written first); a chunk one token longer keeps the prefill path."""
    if variant == "plain":
        data = random_case([20, 33, 9], 9, 3, 64, 16, seed=11)
    else:
        data = variant_case(variant)
    block_size, (kv_heads, head_dim) = data.kv_cache.shape[1], data.kv_cache.shape[3:]
    lens = data.context_lens.tolist()
    sizes = [min(n, k) for n, k in zip(lens, [DECODE_ROWS_PER_CHUNK, 1, 5, 2, 3, 4])]  # a decode among them
    chunks = [(n - k, k, data.block_tables[i].tolist()) for i, (n, k) in enumerate(zip(lens, sizes))]
    rows = [(i, p) for i, (n, k) in enumerate(zip(lens, sizes)) for p in range(n - k, n)]
    heads = data.q.shape[1]
    q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(3))
    slots = [int(data.block_tables[i, p // block_size]) * block_size + p % block_size for i, p in rows]
    flat = data.kv_cache.view(-1, 2, kv_heads, head_dim)
    new_kv = flat[slots].clone()
    expected = reference(DecodeCase(q, data.kv_cache.clone(), data.block_tables[[i for i, _ in rows]],
                                    torch.tensor([p + 1 for _, p in rows]), data.window, data.softcap))
    flat[slots] = 0.0  # written by paged_attention itself
    meta = AttentionMetadata.build(chunks, block_size, "cpu", kernel, data.window or None)
    assert meta.decode_only and not meta.prefills
    layer = LayerAttention(head_dim**-0.5, data.window or None, data.softcap or None)
    out = paged_attention(q, new_kv, data.kv_cache, meta, layer)
    assert (out.double() - expected).abs().max().item() < 1e-5
    longer = [(0, DECODE_ROWS_PER_CHUNK + 1, list(range(4)))]
    assert len(AttentionMetadata.build(longer, block_size, "cpu", kernel).prefills) == 1
    assert len(AttentionMetadata.build(chunks, block_size, "cpu", None).prefills) == sum(k > 1 for k in sizes)
