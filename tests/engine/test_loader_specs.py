"""Model specs load into native weights and a tokenizer, or fail with an error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import engine.gguf_cache
from engine.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from engine.loader import load_model
from engine.packed_linear import dense
from engine.runner import ModelRunner
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import CHAT_TEMPLATE


def test_hf_directory_loads_weights_tokenizer_and_special_tokens(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["gqa_untied"]))
    cfg = loaded.model_config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (4, 2, 16, False)
    assert loaded.model.dtype == torch.float32
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.bos_token_id == 1
    # config.json's eos (</s>) and tokenizer_config's eos (<|im_end|>) both stop generation.
    assert set(loaded.eos_token_ids) == {2, 4}
    assert loaded.tokenizer.encode("w0 w1").ids == [5, 6]
    assert loaded.name == tiny_model_dirs["gqa_untied"].name


def test_tied_embeddings_share_one_tensor(tiny_model_dirs):
    model = load_model(str(tiny_model_dirs["mha_tied"])).model
    assert model.lm_head is model.embed


def test_dummy_weights_are_seeded_and_need_no_checkpoint(tiny_model_dirs, tmp_path):
    shutil.copy(tiny_model_dirs["gqa_untied"] / "config.json", tmp_path / "config.json")
    first = load_model(f"dummy:{tmp_path / 'config.json'}", seed=3)
    again = load_model(f"dummy:{tmp_path}", seed=3)
    other = load_model(f"dummy:{tmp_path}", seed=4)
    assert torch.equal(dense(first.model.layers[0].qkv), dense(again.model.layers[0].qkv))
    assert not torch.equal(dense(first.model.layers[0].qkv), dense(other.model.layers[0].qkv))
    # No tokenizer beside the config: a byte-level one still round-trips text.
    assert first.tokenizer.decode(first.tokenizer.encode("héllo").ids) == "héllo"
    runner = ModelRunner(first, num_blocks=4, block_size=4)
    seq = Sequence("dummy", first.tokenizer.encode("héllo").ids)
    seq.block_table = [0, 1]
    logits = runner.execute(StepPlan([ScheduledChunk(seq, 0, seq.num_tokens)]))
    assert logits.shape == (1, first.model_config.vocab_size) and torch.isfinite(logits).all()


def test_missing_model_path_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_model(f"dummy:{tmp_path}")


def test_directory_without_safetensors_is_refused(tiny_model_dirs, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dirs["gqa_untied"] / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_non_llama_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="model family .gpt2. .GPT2LMHeadModel. is not served; served model_types: llama.*qwen3"):
        load_model(str(tmp_path))


def test_unknown_rope_scaling_is_refused(tiny_model_dirs, tmp_path):
    config = json.loads((tiny_model_dirs["gqa_untied"] / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported rope scaling .dynamic."):
        load_model(f"dummy:{tmp_path}")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(str(weights))


def test_second_gguf_load_uses_the_safetensors_cache(bundled_model, engine_cache_dir, monkeypatch):
    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(engine.gguf_cache, "convert_gguf", no_gguf)
    again = load_model("bundled", cache_dir=engine_cache_dir)
    assert again.path == bundled_model.path
    assert again.path.is_relative_to(engine_cache_dir)
    assert torch.equal(dense(again.model.layers[5].gate_up), dense(bundled_model.model.layers[5].gate_up))


def test_kv_cache_is_sized_from_the_memory_budget(tiny_model_dirs):
    cfg = load_model(str(tiny_model_dirs["gqa_untied"])).model_config
    per_block = bytes_per_block(cfg, block_size=16, dtype=torch.float32)
    assert per_block == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert num_blocks_for_budget(cfg, 16, torch.float32, 10 * per_block + 1) == 10
    cache = KVCache.allocate(cfg, num_blocks=10, block_size=16, device="cpu", dtype=torch.float32)
    assert cache.layers[0].shape == (10, 16, 2, cfg.num_kv_heads, cfg.head_dim) and len(cache.layers) == cfg.num_layers
