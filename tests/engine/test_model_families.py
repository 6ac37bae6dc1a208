"""Every served family, with its own peft adapters, matches HF transformers (eager attention) and peft
in one mixed batch: prompts longer than the sliding windows, a chunked prefill, a prefix-cache hit,
decodes, and rows of two adapters beside base rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.runner import ModelRunner
from lora_pool import BaseShapes, LoraPool
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import TINY_VOCAB, BlockPool, build_tiny_model, chunk, finish_step
from tests.lora_pool.conftest import ALL_TARGETS, save_random_lora

BLOCK_SIZE = 4
# phi4_mini: Phi-3's architecture with partial rotary and LongRoPE (engine/rope.py), here in its short regime.
FAMILIES = ["llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "phi4_mini", "gemma2", "gemma3", "granite", "smollm3", "olmo2", "olmo3", "exaone4", "ministral", "seed_oss"]
# Phi-3's checkpoints fuse q/k/v and gate/up, so its adapters target the fused modules.
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def _targets(kind: str, attention_only: bool) -> list[str]:
    if kind.startswith("phi"):
        return ["qkv_proj"] if attention_only else PHI3_TARGETS
    return ["q_proj", "v_proj"] if attention_only else ALL_TARGETS


def _random_adapter(base_dir: Path, folder: Path, seed: int, **lora) -> Path:
    return save_random_lora(AutoModelForCausalLM.from_pretrained(base_dir), folder, seed, std=0.15, **lora)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path, dict[str, Path]]:
    """(kind, base checkpoint, adapter name -> peft directory) for one family."""
    kind = request.param
    base = build_tiny_model(tmp_path_factory.mktemp(kind), kind)
    adapters = {
        "all_r8": _random_adapter(base, tmp_path_factory.mktemp(f"{kind}-all"), 1, r=8, lora_alpha=16,
                                  target_modules=_targets(kind, attention_only=False)),
        "attn_r2": _random_adapter(base, tmp_path_factory.mktemp(f"{kind}-attn"), 2, r=2, lora_alpha=4,
                                   target_modules=_targets(kind, attention_only=True)),
    }
    return kind, base, adapters


def _references(base: Path, adapters: dict[str, Path]) -> dict[str | None, torch.nn.Module]:
    load = lambda: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")  # noqa: E731
    refs = {None: load().eval()}
    for name, path in adapters.items():
        refs[name] = PeftModel.from_pretrained(load(), path).eval()
    return refs


@torch.no_grad()
def _last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1].float()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(5, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_batch_with_prefix_hit_chunked_prefill_and_adapters_matches_hf_and_peft(family, linear_path):
    kind, base, adapters = family
    loaded = load_model(str(base))
    config = loaded.model_config
    if config.sliding_window is not None:
        assert config.sliding_window < 9, "prompts must outgrow the window for the test to show it"
    runner = ModelRunner(loaded, num_blocks=96, block_size=BLOCK_SIZE)
    pool = LoraPool(BaseShapes.from_model_config(config), max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        pool.register(name, path)
    refs = _references(base, adapters)
    blocks = BlockPool(96)

    shared = _prompt(8, 1)  # two full blocks, handed over by a prefix-cache hit in step 1
    first = Sequence("first", shared + _prompt(6, 2), adapter="all_r8")
    chunked = Sequence("chunked", _prompt(19, 3))
    other = Sequence("other", _prompt(9, 4), adapter="attn_r2")
    hit = Sequence("hit", shared + _prompt(9, 5), adapter="all_r8")

    def step(chunks) -> None:
        plan = StepPlan(chunks)
        logits = runner.execute(plan, pool.batch_for([(c.seq.adapter, c.num_tokens) for c in plan.chunks]))
        for c, row in zip([c for c in plan.chunks if c.samples], logits):
            expected = _last_logits(refs[c.seq.adapter], c.seq.all_token_ids[: c.end])
            assert expected.abs().max() > 0.5, "reference logits too flat to catch a wrong kernel"
            diff = (torch.log_softmax(row, -1) - torch.log_softmax(expected, -1)).abs().max().item()
            assert diff < 1e-3, f"{kind}: {c.seq.seq_id} [{c.start}, {c.end}): logprobs differ by {diff}"
            assert int(row.argmax()) == int(expected.argmax())
        finish_step(plan, logits)

    # Step 0: two whole prompts and the first chunk of a longer one (a chunk that samples nothing).
    step([chunk(first, 0, 14, blocks, BLOCK_SIZE), chunk(chunked, 0, 10, blocks, BLOCK_SIZE),
          chunk(other, 0, 9, blocks, BLOCK_SIZE)])
    # Step 1: a prefix-cache hit on first's two blocks, the rest of the chunked prompt, two decodes.
    hit.block_table = first.block_table[:2]
    hit.num_computed_tokens = hit.num_cached_tokens = 8
    step([chunk(first, 14, 1, blocks, BLOCK_SIZE), chunk(hit, 8, 9, blocks, BLOCK_SIZE),
          chunk(chunked, 10, 9, blocks, BLOCK_SIZE), chunk(other, 9, 1, blocks, BLOCK_SIZE)])
    # Then decodes of all four, past the windows and across block edges.
    seqs = [first, hit, chunked, other]
    for _ in range(3):
        step([chunk(s, s.num_computed_tokens, 1, blocks, BLOCK_SIZE) for s in seqs])
    assert all(len(s.output_token_ids) >= 4 for s in seqs)
    # The adapters change the output, so the comparisons above can fail.
    tokens = first.all_token_ids[:14]
    assert (_last_logits(refs["all_r8"], tokens) - _last_logits(refs[None], tokens)).abs().max() > 0.1


@pytest.mark.parametrize(("kind", "no_window"), [("mistral", dict(sliding_window=None)),
                                               ("gemma2", dict(layer_types=["full_attention"] * 3))])
def test_the_reference_changes_without_the_window_so_the_parity_test_can_fail(kind, no_window, tmp_path):
    """HF's own model with the window removed gives other logits on these prompt lengths."""
    base = build_tiny_model(tmp_path / kind, kind)
    windowed = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    unwindowed = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager", **no_window).eval()
    tokens = _prompt(17, 6)
    assert (_last_logits(windowed, tokens) - _last_logits(unwindowed, tokens)).abs().max() > 1e-2


# head_dim 8: four rotary pairs.
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), "model family 'gpt_neox'.*not served.*gemma2"),
        (dict(model_type="qwen2", partial_rotary_factor=0.75), "partial rotary.*not supported for Qwen2.*Phi-3"),
        (dict(model_type="phi3", partial_rotary_factor=0.7), "rotate an even number"),
        (dict(model_type="qwen3", attention_bias=True), "Qwen3 configs with attention_bias"),
        (dict(model_type="seed_oss", attention_bias=False), "Seed-OSS configs without attention_bias"),
        (dict(model_type="seed_oss", attention_out_bias=True), "Seed-OSS configs with attention_bias, attention_out"),
        (dict(model_type="gemma2", hidden_activation="gelu"), "unsupported hidden_activation 'gelu'"),
        (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "unsupported rope scaling 'dynamic'"),
        # Llama's HF model keeps the keys it cached under the short factors: not the rule we serve.
        (dict(model_type="llama", rope_scaling=LONGROPE), "longrope scaling is not supported for Llama.*Phi-3"),
        (dict(model_type="phi3", rope_scaling=LONGROPE), "needs original_max_position_embeddings"),
        (dict(model_type="phi3", original_max_position_embeddings=64, rope_scaling={**LONGROPE, "long_factor": [1.0]}),
         "long_factor list of 4 numbers"),
        (dict(model_type="gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                                         "full_attention": {"rope_type": "default"}}),
         "rope scaling 'linear' on sliding layers"),
        (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), "model family 'gemma3'"),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_what_a_family_cannot_serve_is_refused_by_name(overrides, message):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "window", "layers"),
    [
        (dict(model_type="mistral", sliding_window=4096), 4096, (0, 1, 2, 3)),
        (dict(model_type="mistral", sliding_window=None), None, ()),
        # A window as long as the context changes nothing: no window.
        (dict(model_type="mistral", sliding_window=32768), None, ()),
        # Qwen's windows apply only with use_sliding_window, from max_window_layers on.
        (dict(model_type="qwen2", sliding_window=4096, max_window_layers=2), None, ()),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4096, max_window_layers=3), 4096, (3,)),
        (dict(model_type="gemma2", sliding_window=4096), 4096, (0, 2)),
        (dict(model_type="gemma2", sliding_window=4096, layer_types=["full_attention", "sliding_attention"] * 2),
         4096, (1, 3)),
        (dict(model_type="ministral", sliding_window=4096), 4096, (0, 1, 2, 3)),
        (dict(model_type="ministral", sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 2),
         4096, (0, 2)),
        # Gemma 3: from layer_types, or in older configs every sliding_window_pattern-th layer global.
        (dict(model_type="gemma3_text", sliding_window=512, layer_types=["sliding_attention", "full_attention"] * 2),
         512, (0, 2)),
        (dict(model_type="gemma3_text", sliding_window=512, sliding_window_pattern=2), 512, (0, 2)),
    ],
)
def test_sliding_window_layers_follow_hf_config_rules(overrides, window, layers):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                max_position_embeddings=8192)
    config = ModelConfig.from_dict({**base, **overrides})
    assert (config.sliding_window, config.sliding_layers) == (window, layers)


def test_gemma3_configs_old_and_new_give_each_layer_kind_its_rope():
    """transformers 5 writes one rope dict per layer type; older Gemma 3 configs a global rope at the
    top level, the local base apart and a pattern instead of layer types."""
    base = dict(model_type="gemma3_text", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                num_attention_heads=2, sliding_window=512, max_position_embeddings=8192)
    new = ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                                 "rope_parameters": {
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}})
    old = ModelConfig.from_dict({**base, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert new == old
    assert (new.rope_theta, new.rope_scaling, new.local_rope_theta) == (1e6, {"rope_type": "linear", "factor": 8.0},
                                                                      10000.0)
    assert new.local_rope_layers == new.sliding_layers == (0, 1, 2, 3, 4)


def test_smollm3s_nope_layers_and_granites_multipliers_are_read_from_their_configs():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=8, num_attention_heads=2)
    assert ModelConfig.from_dict({**base, "model_type": "smollm3"}).nope_layers == (3, 7)  # every 4th by default
    assert ModelConfig.from_dict({**base, "model_type": "smollm3", "no_rope_layers": [1, 0] * 4}).nope_layers == (
        1, 3, 5, 7)
    assert ModelConfig.from_dict({**base, "model_type": "llama", "no_rope_layers": [0] * 8}).nope_layers == ()
    granite = ModelConfig.from_dict({**base, "model_type": "granite", "embedding_multiplier": 12.0,
                                     "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                                     "logits_scaling": 8.0})
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attn_scale, granite.logits_scaling) == (
        12.0, 0.22, 0.0078125, 8.0)


def test_olmo3s_older_configs_take_a_global_layer_every_fourth_and_the_global_base_for_sliding_layers():
    base = dict(model_type="olmo3", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                num_attention_heads=2, sliding_window=64, max_position_embeddings=8192, rope_theta=500000.0)
    config = ModelConfig.from_dict(base)
    assert config.sliding_layers == config.local_rope_layers == (0, 1, 2, 4, 5, 6)
    assert config.local_rope_theta == config.rope_theta == 500000.0


def test_exaone4s_global_layers_take_no_rope_only_beside_windows_and_its_lg_pattern_is_read():
    base = dict(model_type="exaone4", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                num_attention_heads=2, max_position_embeddings=8192)
    hybrid = ModelConfig.from_dict({**base, "sliding_window": 64, "sliding_window_pattern": "LLLG"})
    assert hybrid.nope_layers == (3, 7) and hybrid.sliding_layers == (0, 1, 2, 4, 5, 6)
    assert ModelConfig.from_dict({**base, "sliding_window": None}).nope_layers == ()
