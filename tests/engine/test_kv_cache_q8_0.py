"""The 8-bit KV cache (``kv_cache_dtype`` "q8_0"): its bytes are llama.cpp's Q8_0, both writers store the
same bytes, the decode kernel and every fallback attend to exactly the stored values, and the engine serves
with it end to end, refusing it where it cannot."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from engine.attention import AttentionMetadata, LayerAttention, paged_attention, rope_decode_attention
from engine.attention_kernels import cpu_decode_kernel
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCache, bytes_per_token, num_blocks_for_budget
from engine.kv_quant import dequantize_q8_0, head_bytes, quantize_q8_0, read_slots, write_slots
from engine.model_config import ModelConfig
from engine.request import Delta, EngineRequest, SamplingParams
from engine.rope import apply_rope_
from gateway.settings import SettingsError, load_settings
from tests.engine.conftest import engines_on
from tests.engine.paged_attention_reference import CASES, VARIANTS, DecodeCase, random_case, reference, variant_case

Q8_CASES = [name for name, (_, _, _, head_dim, _) in CASES.items() if head_dim % 32 == 0]
Q8_VARIANTS = [name for name, (case, _, _) in VARIANTS.items() if CASES[case][3] % 32 == 0]


@pytest.fixture(scope="module")
def kernel():
    kernel = cpu_decode_kernel()
    assert kernel is not None, "the C++ paged attention kernel did not build on this machine (see the log)"
    return kernel


def quantized(case: DecodeCase) -> tuple[DecodeCase, DecodeCase]:
    """``case`` with its pool in Q8_0 bytes, and the same with the float values those bytes hold (the reference)."""
    blocks = quantize_q8_0(case.kv_cache)
    exact = DecodeCase(case.q, dequantize_q8_0(blocks), case.block_tables, case.context_lens, case.window, case.softcap)
    return DecodeCase(case.q, blocks, case.block_tables, case.context_lens, case.window, case.softcap), exact


def test_q8_0_bytes_are_llama_cpps_for_the_same_values():
    """gguf-py's quantizer is llama.cpp's Q8_0 written in numpy: the same bytes, block for block."""
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(0)) * 3
    x[5, :32] = 0.0  # a group of zeros: a zero scale, zero values
    ours = quantize_q8_0(x)
    theirs = gguf_quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert ours.shape == (37, 4 * 34) and ours.dtype == torch.uint8
    assert np.array_equal(ours.numpy(), theirs)


def test_q8_0_round_trip_is_within_half_a_step_of_each_groups_scale():
    scales = torch.logspace(-2, 2, 64)[:, None, None, None]
    x = torch.randn(64, 2, 3, 64, generator=torch.Generator().manual_seed(1)) * scales
    back = dequantize_q8_0(quantize_q8_0(x))
    step = x.reshape(*x.shape[:-1], 2, 32).abs().amax(-1, keepdim=True) / 127
    error = (back - x).reshape(*x.shape[:-1], 2, 32).abs()
    # Half a step from rounding, and the scale's float16 rounding over at most 127 steps (scales above
    # float16's subnormals, where its precision is coarser, as in llama.cpp).
    assert (error <= step * (0.5 + 127 * 2**-11) + 1e-12).all()
    assert head_bytes(64) == 68 and head_bytes(128) == 136


def test_write_and_read_slots_round_trip_through_a_q8_0_pool():
    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
                                        "vocab_size": 64})
    pool = KVCache.allocate(config, 4, 8, "cpu", "q8_0").layers[1]
    assert pool.shape == (4, 8, 2, 2, 68) and pool.dtype == torch.uint8
    kv = torch.randn(5, 2, 2, 64, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([3, 9, 10, 30, 0])
    write_slots(pool, slots, kv)
    assert torch.equal(read_slots(pool, slots, torch.float32), dequantize_q8_0(quantize_q8_0(kv)))
    assert read_slots(pool, torch.tensor([1]), torch.float32).abs().max() == 0  # untouched slots stay zero


def test_a_q8_0_pool_holds_about_four_times_the_tokens_of_float32_in_the_same_bytes():
    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                                        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                                        "vocab_size": 64})
    assert bytes_per_token(config, torch.float32) == 46080
    assert bytes_per_token(config, "q8_0") == 2 * 30 * 3 * 68
    budget = 256 * 2**20
    ratio = num_blocks_for_budget(config, 16, "q8_0", budget) / num_blocks_for_budget(config, 16, torch.float32, budget)
    assert 3.7 < ratio < 3.8


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", Q8_CASES + Q8_VARIANTS)
def test_cpu_kernel_over_a_q8_0_pool_matches_float64_over_its_values(kernel, case, threads):
    if case in VARIANTS:
        data = variant_case(case)
    else:
        lens, heads, kv_heads, head_dim, block_size = CASES[case]
        data = random_case(lens, heads, kv_heads, head_dim, block_size, seed=len(case))
    blocks, exact = quantized(data)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(blocks.q, blocks.kv_cache, blocks.block_tables, blocks.context_lens, blocks.scale, blocks.window,
                     blocks.softcap)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.float32
    assert (out.double() - reference(exact)).abs().max().item() < 1e-5
    # The values are not the float pool's: the comparison above is with what was stored.
    assert (reference(exact) - reference(data)).abs().max().item() > 1e-4


def test_cpu_kernel_takes_bfloat16_queries_over_a_q8_0_pool(kernel):
    lens, heads, kv_heads, head_dim, block_size = CASES["smollm2_gqa"]
    data = random_case(lens, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=4)
    blocks, exact = quantized(data)
    out = kernel(blocks.q, blocks.kv_cache, blocks.block_tables, blocks.context_lens, blocks.scale)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(exact)).abs().max().item() < 1e-2


def test_cpu_kernel_refuses_q8_0_pools_of_the_wrong_head_size(kernel):
    data = random_case([5], 4, 2, 64, 4)
    blocks, _ = quantized(data)
    with pytest.raises(RuntimeError, match="34 bytes"):
        kernel(data.q[..., :48], blocks.kv_cache, data.block_tables, data.context_lens, 0.125)
    with pytest.raises(RuntimeError, match="34 bytes"):
        kernel(data.q, blocks.kv_cache[..., :34].contiguous(), data.block_tables, data.context_lens, 0.125)


@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "gathered"])
@pytest.mark.parametrize("case", ["smollm2_gqa", "single_sequence", "window_across_blocks"])
def test_a_step_over_a_q8_0_pool_writes_its_keys_and_attends_to_the_stored_values(kernel, case, with_kernel):
    """paged_attention quantizes the step's K/V into the pool, then attends: the kernel and the gathered
    fallback both match the float64 attention over the pool's values."""
    data = variant_case(case) if case in VARIANTS else random_case(*CASES[case], seed=3)
    lens, block_size, (kv_heads, head_dim) = data.context_lens.tolist(), data.kv_cache.shape[1], data.kv_cache.shape[3:]
    last = [int(data.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            for i, n in enumerate(lens)]
    new_kv = data.kv_cache.reshape(-1, 2, kv_heads, head_dim)[last].clone()
    blocks, exact = quantized(data)
    blocks.kv_cache.view(-1, 2, kv_heads, 68)[last] = 0
    chunks = [(n - 1, 1, data.block_tables[i].tolist()) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build(chunks, block_size, "cpu", kernel if with_kernel else None, data.window or None)
    out = paged_attention(data.q, new_kv, blocks.kv_cache, meta, LayerAttention(head_dim**-0.5, data.window or None))
    assert (out.double() - reference(exact)).abs().max().item() < 1e-5


def test_a_later_prefill_chunk_reads_its_context_back_from_a_q8_0_pool(kernel):
    """A chunk that starts past 0 (chunked prefill, a prefix-cache hit) attends to the context the pool
    holds, dequantized, and to its own keys as they were stored."""
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 8
    context, chunk = 21, 12
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(context + chunk, 2, kv_heads, head_dim, generator=g)
    q = torch.randn(chunk, heads, head_dim, generator=g)
    pool = torch.zeros(6, block_size, 2, kv_heads, 68, dtype=torch.uint8)
    table = [4, 0, 5, 2, 1]
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context + chunk)])
    write_slots(pool, slots[:context], kv[:context])
    meta = AttentionMetadata.build([(context, chunk, table)], block_size, "cpu", kernel)
    assert len(meta.prefills) == 1 and not meta.prefills[0].starts_at_zero
    out = paged_attention(q, kv[context:], pool, meta, LayerAttention(head_dim**-0.5))
    stored = dequantize_q8_0(quantize_q8_0(kv)).double()
    keys = stored[:, 0].repeat_interleave(heads // kv_heads, 1)
    values = stored[:, 1].repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * head_dim**-0.5
    mask = torch.arange(context + chunk)[None, :] <= torch.arange(context, context + chunk)[:, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values)
    assert (out.double() - expected.reshape(chunk, -1)).abs().max().item() < 1e-5


@pytest.mark.parametrize("threads", [1, 2])
def test_rope_decode_attention_quantizes_into_a_q8_0_pool_as_the_torch_writer_does(kernel, threads):
    """The fused decode call's writer (csrc/kv_heads.h) stores the very bytes quantize_q8_0 stores for the
    rotated keys and the values, touches nothing else, and attends to the pool's values."""
    lens, heads, kv_heads, head_dim, block_size = CASES["smollm2_gqa"]
    data = random_case(lens, heads, kv_heads, head_dim, block_size, seed=8)
    blocks, _ = quantized(data)
    batch = len(lens)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=g) * 4
    angles = torch.rand(batch, head_dim // 2, generator=g) * 6.28
    cos, sin = torch.cat((angles.cos(),) * 2, -1)[:, None], torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    rotated = qkv.clone()
    apply_rope_(rotated[:, : (heads + kv_heads) * head_dim].view(batch, heads + kv_heads, head_dim), cos, sin)
    slots = torch.tensor([int(data.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)])
    expected_pool = blocks.kv_cache.clone()
    write_slots(expected_pool, slots, rotated[:, heads * head_dim:].view(batch, 2, kv_heads, head_dim))

    chunks = [(n - 1, 1, data.block_tables[i].tolist()) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build(chunks, block_size, "cpu", kernel)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = rope_decode_attention(qkv, cos, sin, blocks.kv_cache, meta, LayerAttention(head_dim**-0.5), heads)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(blocks.kv_cache, expected_pool)
    expected = reference(DecodeCase(rotated[:, : heads * head_dim].view(batch, heads, head_dim),
                                    dequantize_q8_0(expected_pool), data.block_tables, data.context_lens))
    assert (out.double() - expected).abs().max().item() < 1e-4


@pytest.fixture
def make_bundled_engine(engine_cache_dir):
    yield from engines_on(dict(model="bundled", cache_dir=str(engine_cache_dir), kv_cache_bytes=64 * 2**20,
                               max_num_seqs=4, max_loras=0))


def _greedy(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    async def run() -> list[Delta]:
        request = EngineRequest("r", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                            logprobs=0))
        return [delta async for delta in engine.generate(request)]

    deltas = asyncio.run(run())
    return [t for d in deltas for t in d.token_ids], [entry.logprob for d in deltas for entry in d.logprobs]


def test_the_bundled_model_decodes_with_a_q8_0_pool_close_to_float32s(make_bundled_engine):
    """The same prompt of real text, 24 greedy tokens, the pool in float32 and in Q8_0: the Q8_0 pool is uint8
    and holds about 3.8x the tokens in the same bytes, and its logprobs of the tokens both chose stay near
    float32's."""
    plain, _ = make_bundled_engine()
    q8, _ = make_bundled_engine(kv_cache_dtype="q8_0")
    prompt = plain.tokenizer.encode("The history of the city begins with a small settlement on the river, where "
                                    "traders stopped to rest before the long road north. Over the centuries it grew")
    tokens, logprobs = _greedy(plain, prompt, 24)
    q8_tokens, q8_logprobs = _greedy(q8, prompt, 24)
    assert q8.runner.kv_cache.layers[0].dtype == torch.uint8
    assert 3.7 < q8.num_kv_blocks / plain.num_kv_blocks < 3.8
    same = next((i for i, (a, b) in enumerate(zip(tokens, q8_tokens)) if a != b), len(tokens))
    assert same >= 8, (tokens, q8_tokens)
    diffs = [abs(a - b) for a, b in zip(logprobs[:same], q8_logprobs[:same])]
    # Eight bits a value move a 135M model's logprobs by a few hundredths of a nat (its keys carry outliers
    # that set their groups' scales); bench/RESULTS.md has the figures.
    assert sum(diffs) / len(diffs) < 0.06 and max(diffs) < 0.25


def test_q8_0_pool_is_refused_where_it_cannot_serve():
    with pytest.raises(ValueError, match="CPU attention kernel only"):
        EngineConfig(device="cuda", kv_cache_dtype="q8_0")
    with pytest.raises(ValueError, match="auto or q8_0"):
        EngineConfig(kv_cache_dtype="q4_0")
    with pytest.raises(SettingsError, match="auto or q8_0"):
        load_settings({}, {"TIERGATE_KV_CACHE_DTYPE": "fp8"})
    with pytest.raises(SettingsError, match="CPU attention kernel only"):
        load_settings({"device": "cuda", "kv_cache_dtype": "q8_0"}, {})
    assert load_settings({}, {"TIERGATE_KV_CACHE_DTYPE": "q8_0"}).kv_cache_dtype == "q8_0"
    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                        "vocab_size": 64})
    with pytest.raises(ValueError, match="multiple of 32, this model's is 16"):
        KVCache.allocate(config, 4, 8, "cpu", "q8_0")


def test_the_cli_refuses_an_unknown_or_misplaced_kv_cache_dtype_in_one_line(capsys):
    from gateway.cli import main

    with pytest.raises(SystemExit) as exit_info:  # argparse's choices: its usage line and the error
        main(["serve", "--kv-cache-dtype", "q4_0"])
    assert exit_info.value.code != 0 and "invalid choice: 'q4_0'" in capsys.readouterr().err
    assert main(["serve", "--kv-cache-dtype", "q8_0", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "q8_0 is read by the CPU attention kernel only" in err


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_soft_caps_and_windows_scores_over_a_q8_0_pool(kernel, threads):
    """The reference's soft-capped cases have heads of 16, below Q8_0's 32: one of 64 here, with a window."""
    data = random_case([1, 16, 17, 40, 250], 4, 2, 64, 16, seed=12, window=30, softcap=2.0)
    blocks, exact = quantized(data)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(blocks.q, blocks.kv_cache, blocks.block_tables, blocks.context_lens, blocks.scale, 30, 2.0)
    finally:
        torch.set_num_threads(before)
    assert (out.double() - reference(exact)).abs().max().item() < 1e-5
    uncapped = kernel(blocks.q, blocks.kv_cache, blocks.block_tables, blocks.context_lens, blocks.scale, 30)
    assert (uncapped.double() - reference(exact)).abs().max().item() > 1e-3
