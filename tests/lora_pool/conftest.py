"""Fixtures: a tiny random Llama saved to disk and random peft adapters for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lora_pool import BaseShapes

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


def save_random_lora(base: torch.nn.Module, path: Path, seed: int, std: float = 0.2, **lora) -> Path:
    """Save a peft LoRA of ``base`` with random A and B (peft would start B at zero)."""
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * std)
    model.save_pretrained(path)
    return path


def save_adapter(path: Path, seed: int = 1, model_overrides: dict | None = None, **lora) -> Path:
    """A random adapter of the tiny Llama (rank 4 on q and v unless told)."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora}
    return save_random_lora(tiny_model(**(model_overrides or {})), path, seed, **lora)


@pytest.fixture
def shapes() -> BaseShapes:
    return BaseShapes.for_llama(TINY["num_hidden_layers"], TINY["hidden_size"], TINY["intermediate_size"],
                                TINY["num_attention_heads"], TINY["num_key_value_heads"])


@pytest.fixture
def adapter_dir(tmp_path: Path):
    """Factory: adapter_dir(name, **lora_config) -> a saved adapter directory."""
    def make(name: str, seed: int = 1, model_overrides: dict | None = None, **lora) -> Path:
        return save_adapter(tmp_path / name, seed, model_overrides, **lora)
    return make


@pytest.fixture
def adapter_ready():
    """Whether a pool's step could use an adapter without reading it from disk (in a slot or the host cache)."""
    def ready(pool, name: str) -> bool:
        return name in pool.resident() or name in pool._host
    return ready
