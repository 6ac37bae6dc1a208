"""LongRoPE, YaRN and partial rotary as HF computes them: the frequencies (both of LongRoPE's factor
sets), the attention factors given or derived, and which configs turn them on."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.rope import Rope, rope_attention_factor, rope_inv_freq
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, build_tiny_model, chunk

SHORT = [1.0 + 0.1 * i for i in range(6)]
LONG = [2.0 + 0.7 * i for i in range(6)]


def _configs(partial: float = 0.75, **scaling) -> tuple[Phi3Config, ModelConfig]:
    """A Phi-4-mini-like config (head_dim 16, three quarters rotate) in HF's form and in ours."""
    hf = Phi3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    max_position_embeddings=4096, original_max_position_embeddings=256, partial_rotary_factor=partial,
                    rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG, **scaling))
    return hf, ModelConfig.from_dict(hf.to_dict())


@pytest.mark.parametrize("scaling", [{}, {"factor": 3.0}, {"attention_factor": 1.25}, {"factor": 0.5}])
def test_longrope_frequencies_and_attention_factor_match_hf(scaling):
    hf, ours = _configs(**scaling)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, hf_factor = init(hf, "cpu")
    long, _ = init(hf, "cpu", seq_len=257)
    assert torch.equal(rope_inv_freq(ours), short) and torch.equal(rope_inv_freq(ours, long=True), long)
    assert not torch.equal(short, long)
    assert rope_attention_factor(ours) == pytest.approx(hf_factor, rel=1e-12)


def test_the_default_attention_factor_comes_from_the_context_ratio():
    _, ours = _configs()
    # max_position_embeddings / original = 16 when no factor is given.
    assert rope_attention_factor(ours) == pytest.approx(math.sqrt(1 + math.log(16) / math.log(256)))


def test_a_phi3_128k_style_config_is_read_with_its_original_context_and_legacy_type():
    config = ModelConfig.from_dict(dict(
        model_type="phi3", vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144, rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=[4.0] * 8)))
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.long_context_after == 4096
    assert (config.rotary_dim, config.sliding_window) == (16, None)


def test_partial_rotary_without_scaling_rotates_only_the_leading_dimensions():
    hf, ours = _configs()
    hf_plain = Phi3Config(**{**hf.to_dict(), "rope_scaling": None, "rope_parameters": None})
    ours = ModelConfig.from_dict(hf_plain.to_dict())
    assert ours.rope_scaling is None and ours.long_context_after is None and ours.rotary_dim == 12
    expected = 1.0 / (10000.0 ** (torch.arange(0, 12, 2).float() / 12))
    assert torch.equal(rope_inv_freq(ours), expected)


def test_models_without_longrope_have_one_regime():
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4))
    assert config.long_context_after is None and config.rotary_dim == config.head_dim


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 128},  # Qwen2.5's long-context form
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 0.9},
    {"factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek
])
def test_yarn_frequencies_and_attention_factor_match_hf(scaling):
    hf = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     max_position_embeddings=2048, rope_scaling={"rope_type": "yarn", **scaling})
    ours = ModelConfig.from_dict(hf.to_dict())
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(ours), inv_freq, rtol=1e-6, atol=0)
    plain = 1.0 / hf.rope_parameters["rope_theta"] ** (torch.arange(0, 32, 2).float() / 32)  # head_dim 32
    assert not torch.allclose(inv_freq, plain)  # the scaling changes some frequencies
    assert rope_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-12)


def test_a_yarn_checkpoint_gives_hfs_logits(tmp_path):
    model_dir = build_tiny_model(tmp_path / "yarn", "qwen2", use_sliding_window=False, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16})
    loaded = load_model(str(model_dir))
    assert loaded.model_config.rope_scaling["rope_type"] == "yarn"
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 35)))  # past the original context
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    expected = HFReference(model_dir).logits(seq.all_token_ids)
    assert (runner.execute(plan)[0] - expected).abs().max().item() < 1e-3


def test_tables_looked_up_are_the_tables_computed_for_those_positions_and_grow_past_the_longest_yet():
    _, cfg = _configs(factor=3.0, attention_factor=1.25)
    rope = Rope(cfg, "cpu")
    for positions in ([0], [5, 3, 5], [255, 256], [1000, 2], [70000], [], [4095, 0, 1]):
        at = torch.tensor(positions, dtype=torch.long)
        for dtype in (torch.float32, torch.bfloat16):
            looked_up, computed = rope.tables(at, dtype), rope._computed(at, dtype)
            assert all(a.dtype == dtype and a.shape == (len(positions), 1, cfg.rotary_dim) for a in looked_up)
            assert all(torch.equal(a, b) for a, b in zip(looked_up, computed))
    assert rope._cached[torch.float32][0].shape[0] == 131072  # grown by doubling to hold 70000
