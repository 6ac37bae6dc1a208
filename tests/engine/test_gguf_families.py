"""A GGUF file of another family than Llama loads through transformers' GGUF support, is cached as a
checkpoint directory and served with transformers' own logits for it."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from engine.loader import load_model
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, build_tiny_model, chunk


def write_qwen2_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint's float32 weights in a GGUF file under llama.cpp's names, with a token list."""
    config = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    tokens = [f"w{i}" for i in range(config.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_qwen2_gguf_is_served_with_transformers_logits(tmp_path):
    gguf_file = write_qwen2_gguf(build_tiny_model(tmp_path / "qwen2", "qwen2"), tmp_path / "tiny-qwen2.gguf")
    loaded = load_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert loaded.model_config.model_type == "qwen2" and loaded.name == "tiny-qwen2"
    # The reference is transformers' own reading of the GGUF file: the directory it was cached as.
    reference = HFReference(loaded.path)
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 22)))
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    expected = reference.logits(seq.all_token_ids)
    assert expected.abs().max() > 0.5
    assert (runner.execute(plan)[0] - expected).abs().max().item() < 1e-3
    # The q/k/v biases came through: without them the logits differ.
    biases = next(iter(loaded.model.layers)).qkv_bias
    assert biases.abs().max() > 0
