"""GGUF files of other families than Llama load through transformers' GGUF support, are cached as a
checkpoint directory and served with the logits of the checkpoint they were written from; a file
holding what transformers' GGUF mapping does not read is refused, naming its family."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from engine.loader import load_model
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, build_tiny_model, chunk

ARCHS = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
         "gemma2": gguf.MODEL_ARCH.GEMMA2}


def write_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint's float32 weights in a GGUF file under llama.cpp's names, with the metadata its
    converter writes for the family, and a token list."""
    config = AutoConfig.from_pretrained(model_dir)
    kind, arch = config.model_type, ARCHS[config.model_type]
    rope = config.rope_parameters
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
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
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
        if kind == "gemma2" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's (1 + w) norms with the one added
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# (tiny kind, its config's changes): checkpoints whose every setting transformers' GGUF mapping carries.
SERVED = {
    "qwen2": ("qwen2", {"use_sliding_window": False}),  # GGUF carries no use_sliding_window (off in Qwen's releases)
    "qwen3": ("qwen3", {"head_dim": 128}),  # transformers' Qwen3 default: it does not read key_length
    "phi3": ("phi3", {"sliding_window": None}),
    # Soft-caps and query scale at Gemma2Config's defaults, which the mapping leaves in place.
    "gemma2": ("gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}),
}


@pytest.mark.parametrize("kind", list(SERVED))
def test_a_gguf_is_served_with_the_logits_of_the_checkpoint_it_was_written_from(kind, tmp_path):
    tiny, changes = SERVED[kind]
    model_dir = build_tiny_model(tmp_path / kind, tiny, **changes)
    loaded = load_model(str(write_gguf(model_dir, tmp_path / f"tiny-{kind}.gguf")), cache_dir=tmp_path / "cache")
    assert loaded.model_config.model_type == kind and loaded.name == f"tiny-{kind}"
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 22)))  # longer than the tiny windows
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    expected = HFReference(model_dir).logits(seq.all_token_ids)
    assert expected.abs().max() > 0.5
    assert (runner.execute(plan)[0] - expected).abs().max().item() < 1e-3
    if kind == "qwen2":  # the q/k/v biases came through: without them the logits differ
        assert next(iter(loaded.model.layers)).qkv_bias.abs().max() > 0


@pytest.mark.parametrize(
    ("tiny", "message"),
    [
        ("qwen3", r"Qwen3 GGUF file not served.*qwen3\.attention\.key_length is 24 in the file but 128"),
        ("phi3", r"Phi-3 GGUF file not served.*phi3\.attention\.sliding_window is 7 in the file but None"),
        ("phi3_longrope", r"Phi-3 GGUF file not served.*rope scaling factors \(rope_factors_long\.weight"),
        ("phi4_mini", r"Phi-3 GGUF file not served.*phi3\.rope\.dimension_count is 12 in the file but 16"),
        ("gemma2", r"Gemma 2 GGUF file not served.*gemma2\.attn_logit_softcapping is 2\.0 in the file but 50\.0"),
    ],
)
def test_a_gguf_transformers_would_map_into_another_model_is_refused_by_family(tiny, message, tmp_path):
    gguf_file = write_gguf(build_tiny_model(tmp_path / tiny, tiny), tmp_path / f"tiny-{tiny}.gguf")
    with pytest.raises(ValueError, match=message):
        load_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir()), "a refused file left a cached directory"
