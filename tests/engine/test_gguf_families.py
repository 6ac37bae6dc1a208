"""GGUF files of every family load through transformers' GGUF support, are cached as a checkpoint
directory and served with the logits of the checkpoint they were written from, what transformers'
GGUF mapping does not read (head sizes, windows, soft-caps, partial rotary, Llama 3's and LongRoPE's
rope factors) included; a file whose metadata no config can hold is refused, naming its family."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.gguf_check import llama3_parameters
from engine.loader import load_model
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, build_tiny_model, chunk

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
         "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}


def llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows in llama.cpp's order: each head's two rotary halves interleaved, not stacked."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def llama3_rope_freqs(config) -> np.ndarray:
    """Llama 3's scaling as llama.cpp's converter stores it: the factor each frequency is divided by."""
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plain = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim)
    return (plain / scaled.double()).numpy().astype(np.float32)


def write_gguf(model_dir: Path, out: Path, rope_freqs: np.ndarray | None = None) -> Path:
    """The checkpoint's float32 weights in a GGUF file under llama.cpp's names, with the metadata its
    converter writes for the family, and a token list; ``rope_freqs`` replaces Llama 3's factors."""
    config = AutoConfig.from_pretrained(model_dir)
    kind, arch = config.model_type, ARCHS[config.model_type]
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers: llama.cpp fixes its local ones
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3" or rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config) if rope_freqs is None else rope_freqs)
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_scaling_attn_factors(ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")[1])
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], dtype=np.float32))
    tokens = [f"w{i}" for i in range(config.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's (1 + w) norms with the one added
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = llama_cpp_rows(tensor, heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# (tiny kind, its config's changes).
SERVED = {
    "llama": ("gqa_untied", {}),
    # Llama 3 scaling whose boundaries fall between two frequencies, and one with frequencies between
    # them (the parameters are then solved from the factors).
    "llama3": ("llama3_rope", {}),
    "llama3_between": ("llama3_rope", {"rope_theta": 10000.0, "rope_scaling": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0,
        original_max_position_embeddings=256)}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),  # GGUF carries no use_sliding_window (off in Qwen's releases)
    "qwen3": ("qwen3", {}),  # head_dim 24, not transformers' Qwen3 default of 128
    "phi3": ("phi3", {}),  # a sliding window of 7
    "phi3_longrope": ("phi3_longrope", {}),
    "phi4_mini": ("phi4_mini", {}),  # partial rotary and LongRoPE
    # Soft-caps other than Gemma2Config's defaults. GGUF carries no query scale: transformers'
    # mapping leaves Gemma2Config's 256.
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 256}),
    # Gemma 3 as llama.cpp lays it out: a global layer every sixth, the local base 10000; the
    # global layers' linear scaling is in the file's keys.
    "gemma3": ("gemma3", {"num_layers": 6, "query_pre_attn_scalar": 256,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 1000000.0}}}),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_a_gguf_is_served_with_the_logits_of_the_checkpoint_it_was_written_from(case, tmp_path):
    tiny, changes = SERVED[case]
    model_dir = build_tiny_model(tmp_path / case, tiny, **changes)
    kind = AutoConfig.from_pretrained(model_dir).model_type
    loaded = load_model(str(write_gguf(model_dir, tmp_path / f"tiny-{case}.gguf")), cache_dir=tmp_path / "cache")
    assert loaded.model_config.model_type == kind and loaded.name == f"tiny-{case}"
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 22)))  # longer than the tiny windows
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    expected = HFReference(model_dir).logits(seq.all_token_ids)
    assert expected.abs().max() > 0.5
    assert (runner.execute(plan)[0] - expected).abs().max().item() < 1e-3
    if case == "qwen2":  # the q/k/v biases came through: without them the logits differ
        assert next(iter(loaded.model.layers)).qkv_bias.abs().max() > 0
    if case.startswith("llama3"):
        assert loaded.model_config.rope_scaling["rope_type"] == "llama3"


def test_llama3_parameters_are_solved_from_a_real_llama_31_shape():
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                high_freq_factor=4.0,
                                                                original_max_position_embeddings=8192))
    solved = llama3_parameters(llama3_rope_freqs(config).astype(np.float64), 500000.0, 128)
    assert solved["original_max_position_embeddings"] == 8192
    assert solved["factor"] == pytest.approx(8.0, rel=1e-5)
    assert (solved["low_freq_factor"], solved["high_freq_factor"]) == (pytest.approx(1.0, rel=1e-4),
                                                                      pytest.approx(4.0, rel=1e-4))


def test_rope_factors_no_llama3_config_gives_are_refused(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "gqa_untied")
    factors = np.array([1.0, 1.7, 1.1, 3.0, 2.0, 8.0, 5.0, 8.0], dtype=np.float32)  # not monotone
    gguf_file = write_gguf(model_dir, tmp_path / "odd-factors.gguf", rope_freqs=factors)
    refused = r"Llama 1-3\.x GGUF file not served.*rope scaling factors \(rope_freqs\.weight\)"
    with pytest.raises(ValueError, match=refused):
        load_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir()), "a refused file left a cached directory"
