"""Projections on packed weights (engine/packed_linear.py), through tiergate's panel kernel and through
oneDNN: exact enough to keep HF parity on the bundled model, no more memory than the plain weights, and the
torch.mm fallback on its own."""

from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.model import PROJECTIONS
from engine.packed_linear import (
    FORMS,
    PACKED_OPS_TORCH,
    OneDnnWeight,
    PackedWeight,
    PanelWeight,
    dense,
    linear,
    pack,
    panel_kernel_present,
    weight_form,
)
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, chunk, finish_step


def test_the_installed_torch_is_a_release_the_private_packed_ops_were_checked_on():
    # An upgrade of torch must re-check torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise
    # and then add the release to PACKED_OPS_TORCH; until then the engine would fall back to torch.mm.
    assert torch.__version__.startswith(PACKED_OPS_TORCH)
    assert weight_form("cpu", torch.float32) != "plain"


def test_the_panel_kernel_builds_here_and_is_the_default_form():
    assert panel_kernel_present()
    assert weight_form("cpu", torch.float32) == "panels"


# Row counts across the kernel's tiles (1..12 rows a tile, then more tiles), shapes whose
# outputs are not a multiple of the 16-output panel, so the zero-padded last panel is read, and
# inputs wide enough that the rows go through in several blocks (up to 256 KB of x each: 113 rows of
# 576 inputs, 32 of 2048).
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 33, 130])
@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (100, 33), (576, 1536), (2048, 40)])
def test_every_form_of_a_projection_matches_a_float64_matmul(rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen) * 0.1
    x = torch.randn(rows, shape[0], generator=gen)
    expected = x.double() @ weight.double()
    for form in FORMS:
        packed = pack(weight, form)
        y = linear(x, packed)
        assert y.shape == (rows, shape[1]) and y.dtype == torch.float32
        assert torch.allclose(y.double(), expected, atol=1e-4, rtol=1e-4), form
        assert torch.equal(dense(packed), weight)


def test_the_panel_kernel_reads_rows_with_a_stride_and_answers_an_empty_batch():
    weight = torch.randn(64, 40)
    wide = torch.randn(7, 128)
    strided = wide[:, 32:96]  # rows 128 floats apart
    assert torch.allclose(PanelWeight(weight)(strided), strided @ weight, atol=1e-5)
    assert PanelWeight(weight)(torch.empty(0, 64)).shape == (0, 40)
    wide_weight = torch.randn(2048, 40)
    strided = torch.randn(70, 4096)[:, 1024:3072]  # rows 4096 floats apart, in three row blocks
    # Sums of 2,048 products near 45 in size: float32's rounding alone reaches a few 1e-4 on some of them.
    assert torch.allclose(PanelWeight(wide_weight)(strided).double(), strided.double() @ wide_weight.double(),
                          atol=1e-3)


def test_packing_is_off_for_cuda_other_dtypes_and_when_the_setting_says_so(monkeypatch):
    assert weight_form("cuda", torch.float32) == "plain"
    assert weight_form("cpu", torch.float16) == "plain"
    assert weight_form("cpu", torch.bfloat16) == "panels"  # the bfloat16 opt-in: panels only
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", "onednn")
    assert weight_form("cpu", torch.bfloat16) == "plain"
    monkeypatch.delenv("TIERGATE_PACKED_WEIGHTS")
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", "0")
    assert weight_form("cpu", torch.float32) == "plain"
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", "onednn")
    assert weight_form("cpu", torch.float32) == "onednn"


def _weight_bytes(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS] + [model.head]
    total += sum(w.nbytes for w in packed if isinstance(w, PackedWeight))
    if isinstance(model.head, torch.Tensor):  # the unpacked CPU head's transposed copy
        total += model.head.numel() * model.head.element_size()
    return total


@pytest.mark.parametrize("form", ["panels", "onednn"])
@pytest.mark.parametrize("kind", ["gqa_untied", "mha_tied"])
def test_packing_replaces_the_plain_weights_and_unpacking_gives_them_back_exactly(tiny_model_dirs, monkeypatch, kind, form):
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", "0")
    plain = load_model(str(tiny_model_dirs[kind])).model
    plain.prepare_weights()
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", form)
    packed = load_model(str(tiny_model_dirs[kind])).model
    assert not packed.is_packed  # the runner packs, once loading is done
    packed.prepare_weights()

    assert packed.is_packed and not plain.is_packed and packed.weight_form == form
    weight_class = PanelWeight if form == "panels" else OneDnnWeight
    for layer in packed.layers:
        assert all(isinstance(getattr(layer, name), weight_class) for name in PROJECTIONS)
        assert not any(name in dict(layer.named_parameters()) for name in PROJECTIONS)
    # Today's CPU model keeps the head plus a transposed copy; packed keeps one packed head.
    assert _weight_bytes(packed) <= _weight_bytes(plain)
    assert (packed.lm_head is packed.embed) == (kind == "mha_tied")

    packed.unpack_weights()
    assert not packed.is_packed
    for mine, theirs in zip(packed.layers, plain.layers):
        for name in PROJECTIONS:
            assert torch.equal(getattr(mine, name), dense(getattr(theirs, name)))
    assert torch.equal(packed.lm_head, plain.lm_head)
    packed.prepare_weights()
    assert packed.is_packed


def _hf_greedy(ref: HFReference, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logp = torch.log_softmax(ref.logits(ids), dim=-1)
        ids.append(int(logp.argmax()))
        logprobs.append(logp)
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def bundled_reference(bundled_model):
    return HFReference(bundled_model.path)


def test_bundled_model_tokens_and_logprobs_match_hf_over_prefill_chunks_decodes_and_a_prefix_hit(
    bundled_model, bundled_reference, engine_cache_dir, linear_path
):
    """Greedy tokens identical and every logprob within 1e-3 of HF's, for a prompt prefilled in
    two chunks beside another sequence's decodes, and a second prompt reusing its cached prefix."""
    loaded = load_model("bundled", cache_dir=engine_cache_dir)  # a fresh copy: this one is (un)packed per path
    block_size, num_blocks = 16, 24
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size)
    assert runner.model.weight_form == linear_path
    pool = BlockPool(num_blocks)
    encode = lambda text: loaded.tokenizer.encode(text).ids  # noqa: E731
    shared = encode("<|im_start|>system\nYou are a concise assistant who answers in one sentence.<|im_end|>\n")
    first = Sequence("first", shared + encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"))
    second = Sequence("second", shared + encode("<|im_start|>user\nName a large ocean.<|im_end|>\n<|im_start|>assistant\n"))
    steps = 6
    logprobs: dict[str, list[torch.Tensor]] = {"first": [], "second": []}

    def run(plan: StepPlan) -> None:
        logits = runner.execute(plan)
        for c, row in zip([c for c in plan.chunks if c.samples], logits):
            logprobs[c.seq.seq_id].append(torch.log_softmax(row, dim=-1))
        finish_step(plan, logits)

    split = 10
    run(StepPlan([chunk(first, 0, split, pool, block_size)]))  # a chunk that samples nothing
    run(StepPlan([chunk(first, split, first.num_tokens - split, pool, block_size)]))
    # The second prompt finds the shared system prompt's full blocks in the cache.
    cached = len(shared) // block_size * block_size
    second.block_table = first.block_table[: cached // block_size]
    second.num_computed_tokens = second.num_cached_tokens = cached
    run(StepPlan([chunk(first, first.num_computed_tokens, 1, pool, block_size),
                  chunk(second, cached, second.num_tokens - cached, pool, block_size)]))
    while len(first.output_token_ids) < steps or len(second.output_token_ids) < steps:
        run(StepPlan([chunk(s, s.num_computed_tokens, 1, pool, block_size)
                      for s in (first, second) if len(s.output_token_ids) < steps]))

    assert cached >= block_size
    for seq in (first, second):
        expected_tokens, expected_logprobs = _hf_greedy(bundled_reference, seq.prompt_token_ids, steps)
        assert seq.output_token_ids == expected_tokens
        for step, (mine, theirs) in enumerate(zip(logprobs[seq.seq_id], expected_logprobs)):
            diff = (mine - theirs).abs().max().item()
            assert diff < 1e-3, f"{seq.seq_id} step {step}: max abs logprob diff {diff}"
    assert "Paris" in loaded.tokenizer.decode(first.output_token_ids)
