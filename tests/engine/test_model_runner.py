"""The native forward over the paged KV cache matches HF transformers' own model, logit for logit."""

from __future__ import annotations

import pytest
import torch

from engine import decoder_layer
from engine.attention import DECODE_ROWS_PER_CHUNK
from engine.loader import load_model
from engine.attention_kernels import decode_kernel_for, prefill_kernel_for
from engine.runner import ModelRunner
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import TINY_CONFIGS, TINY_VOCAB, BlockPool, HFReference, chunk, finish_step

BLOCK_SIZE = 4
NUM_BLOCKS = 96


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, TINY_VOCAB, (length,), generator=g).tolist()


@pytest.fixture(params=["kernels", "torch"])
def attention_kernels(request):
    """Attention through the CPU kernels (paged decode, causal prefill where the shapes allow),
    or through the fallbacks: gathered contexts for decodes, SDPA for prefills."""
    if request.param == "torch":
        return False
    assert decode_kernel_for("cpu") is not None, "the C++ attention kernels did not build on this machine (see the log)"
    return True


@pytest.fixture(params=list(TINY_CONFIGS))
def setup(request, tiny_model_dirs, attention_kernels, linear_path):
    path = tiny_model_dirs[request.param]
    kernels = "auto" if attention_kernels else None
    runner = ModelRunner(load_model(str(path)), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, decode_kernel=kernels,
                         prefill_kernel=kernels)
    assert runner.model.weight_form == linear_path
    head_dim = runner.config.head_dim
    # The prefill kernel serves head dims that are multiples of 16; the tiny configs cover both kinds.
    expected = attention_kernels and head_dim % 16 == 0
    assert (runner.prefill_kernel is not None) == expected
    assert (prefill_kernel_for("cpu", torch.float32, head_dim) is not None) == (head_dim % 16 == 0)
    return runner, HFReference(path), BlockPool(NUM_BLOCKS)


def test_single_sequence_prefill_then_decodes_match_hf(setup, assert_matches_hf):
    runner, ref, pool = setup
    seq = Sequence("a", _prompt(11, seed=1))
    plan = StepPlan([chunk(seq, 0, 11, pool, BLOCK_SIZE)])
    for _ in range(6):
        logits = runner.execute(plan)
        assert_matches_hf(ref, plan, logits)
        finish_step(plan, logits)
        plan = StepPlan([chunk(seq, seq.num_computed_tokens, 1, pool, BLOCK_SIZE)])


def test_mixed_chunked_prefills_and_decodes_in_one_step_match_hf(setup, assert_matches_hf):
    """Prompts of different lengths split into chunks across steps, batched with other sequences' decodes."""
    runner, ref, pool = setup
    seqs = [Sequence(str(i), _prompt(n, seed=i)) for i, n in enumerate([3, 9, 22, 30])]
    budget = 16
    for step in range(12):
        chunks = []
        left = budget
        # Decodes first in some steps and last in others: rows in any order must work.
        order = seqs if step % 2 == 0 else list(reversed(seqs))
        for seq in order:
            todo = seq.num_tokens - seq.num_computed_tokens
            n = min(todo, left)
            if n > 0 and len(seq.output_token_ids) < 4:
                chunks.append(chunk(seq, seq.num_computed_tokens, n, pool, BLOCK_SIZE))
                left -= n
        if not chunks:
            break
        plan = StepPlan(chunks)
        logits = runner.execute(plan)
        assert_matches_hf(ref, plan, logits)
        finish_step(plan, logits)
        seqs = seqs[1:] + seqs[:1]
    assert all(len(s.output_token_ids) == 4 for s in seqs)


def test_decode_rows_interleaved_with_prefill_rows_match_hf(setup, assert_matches_hf):
    runner, ref, pool = setup
    a, b, c = Sequence("a", _prompt(6, 7)), Sequence("b", _prompt(13, 8)), Sequence("c", _prompt(9, 9))
    first = StepPlan([chunk(a, 0, 6, pool, BLOCK_SIZE), chunk(c, 0, 9, pool, BLOCK_SIZE)])
    finish_step(first, runner.execute(first))
    # decode, prefill, decode: the decode rows are not contiguous.
    plan = StepPlan([chunk(a, 6, 1, pool, BLOCK_SIZE), chunk(b, 0, 13, pool, BLOCK_SIZE), chunk(c, 9, 1, pool, BLOCK_SIZE)])
    logits = runner.execute(plan)
    assert logits.shape == (3, TINY_VOCAB) and logits.dtype == torch.float32
    assert_matches_hf(ref, plan, logits)


def test_a_decode_batch_of_different_context_lengths_gives_hf_greedy_tokens_and_logprobs(setup):
    """Contexts of 1 to 30 tokens decoded together: within one block, on block edges, across several blocks."""
    runner, ref, pool = setup
    seqs = [Sequence(str(n), _prompt(n, seed=n)) for n in (1, 3, 4, 8, 13, 30)]
    finish_step(plan := StepPlan([chunk(s, 0, s.num_tokens, pool, BLOCK_SIZE) for s in seqs]), runner.execute(plan))
    for _ in range(3):
        plan = StepPlan([chunk(s, s.num_computed_tokens, 1, pool, BLOCK_SIZE) for s in seqs])
        logits = runner.execute(plan)
        for seq, row in zip(seqs, logits):
            expected = torch.log_softmax(ref.logits(seq.all_token_ids), dim=-1)
            assert int(row.argmax()) == int(expected.argmax())
            diff = (torch.log_softmax(row, dim=-1) - expected).abs().max().item()
            assert diff < 1e-3, f"seq of {seq.num_prompt_tokens} prompt tokens: logprobs differ by {diff}"
        finish_step(plan, logits)


def test_steps_of_decodes_only_rotate_write_and_attend_in_one_call_and_match_hf(setup, assert_matches_hf, monkeypatch):
    """With the CPU kernels, every layer of a step of decodes only goes through attention.rope_decode_attention
    (RoPE, the KV write and the attention in one call), and no layer of a step that holds a prefill does;
    without them no layer does. The logits are HF's either way."""
    runner, ref, pool = setup
    calls = []
    one_call = decoder_layer.rope_decode_attention
    monkeypatch.setattr(decoder_layer, "rope_decode_attention", lambda *args: calls.append(1) or one_call(*args))
    a, b = Sequence("a", _prompt(12, 21)), Sequence("b", _prompt(DECODE_ROWS_PER_CHUNK + 1, 22))
    plan = StepPlan([chunk(a, 0, 12, pool, BLOCK_SIZE)])
    finish_step(plan, runner.execute(plan))
    # b's prompt is one token more than a chunk that attends as decode rows: a prefill.
    plan = StepPlan([chunk(a, 12, 1, pool, BLOCK_SIZE), chunk(b, 0, b.num_tokens, pool, BLOCK_SIZE)])
    assert_matches_hf(ref, plan, logits := runner.execute(plan))
    finish_step(plan, logits)
    assert calls == []
    plan = StepPlan([chunk(a, 13, 1, pool, BLOCK_SIZE), chunk(b, b.num_computed_tokens, 1, pool, BLOCK_SIZE)])
    assert_matches_hf(ref, plan, runner.execute(plan))
    # Layers that norm q and k (qwen3), rotate part of each head or take no RoPE (smollm3's) keep the calls apart.
    plain_rope_layers = [layer for layer in runner.model.layers if layer.plain_rope]
    assert len(calls) == (len(plain_rope_layers) if runner.decode_kernel is not None else 0)


def test_prefix_cached_blocks_computed_by_another_sequence_are_reused(setup, assert_matches_hf):
    runner, ref, pool = setup
    shared = _prompt(12, 3)  # three full blocks
    first = Sequence("first", shared + _prompt(5, 4))
    plan = StepPlan([chunk(first, 0, first.num_tokens, pool, BLOCK_SIZE)])
    finish_step(plan, runner.execute(plan))

    second = Sequence("second", shared + _prompt(7, 5))
    second.block_table = first.block_table[:3]  # what a prefix-cache hit hands over
    second.num_computed_tokens = second.num_cached_tokens = 12
    plan = StepPlan([chunk(second, 12, 7, pool, BLOCK_SIZE), chunk(first, first.num_computed_tokens, 1, pool, BLOCK_SIZE)])
    logits = runner.execute(plan)
    assert_matches_hf(ref, plan, logits)
    finish_step(plan, logits)
    plan = StepPlan([chunk(second, second.num_computed_tokens, 1, pool, BLOCK_SIZE)])
    assert_matches_hf(ref, plan, runner.execute(plan))


def test_recompute_after_preemption_matches_hf(setup, assert_matches_hf):
    runner, ref, pool = setup
    victim = Sequence("victim", _prompt(10, 11))
    plan = StepPlan([chunk(victim, 0, 10, pool, BLOCK_SIZE)])
    for _ in range(3):
        finish_step(plan, runner.execute(plan))
        plan = StepPlan([chunk(victim, victim.num_computed_tokens, 1, pool, BLOCK_SIZE)])

    # Preempted: its blocks go back and another sequence overwrites them.
    pool.release(victim)
    victim.num_computed_tokens = 0
    victim.recompute_until = victim.num_tokens
    other = Sequence("other", _prompt(24, 12))
    plan = StepPlan([chunk(other, 0, 24, pool, BLOCK_SIZE)])
    finish_step(plan, runner.execute(plan))

    # Recompute prompt plus generated tokens in two chunks, then keep decoding.
    plan = StepPlan([chunk(victim, 0, 7, pool, BLOCK_SIZE)])
    assert runner.execute(plan).shape[0] == 0  # a chunk short of the end samples nothing
    finish_step(plan, torch.empty(0, TINY_VOCAB))
    plan = StepPlan([chunk(victim, 7, victim.num_tokens - 7, pool, BLOCK_SIZE)])
    for _ in range(3):
        logits = runner.execute(plan)
        assert_matches_hf(ref, plan, logits)
        finish_step(plan, logits)
        plan = StepPlan([chunk(victim, victim.num_computed_tokens, 1, pool, BLOCK_SIZE)])


def test_a_block_table_too_short_for_the_chunk_is_refused(tiny_model_dirs):
    runner = ModelRunner(load_model(str(tiny_model_dirs["gqa_untied"])), num_blocks=8, block_size=BLOCK_SIZE)
    seq = Sequence("short", _prompt(9, 1))
    seq.block_table = [0, 1]
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        runner.execute(StepPlan([ScheduledChunk(seq=seq, start=0, num_tokens=9)]))
