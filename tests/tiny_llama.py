"""The tests' tiny random Llama: a config-only checkpoint (loaded as ``dummy:<dir>``) whose 256-token byte
tokenizer spells any text, and a random peft LoRA of its shape."""

from __future__ import annotations

import json
from pathlib import Path

# Honours add_generation_prompt and, as Qwen3's does, an enable_thinking variable.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                 "<assistant>{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
                 "{% endif %}")

BYTE_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip


def write_byte_llama(folder: Path, max_position_embeddings: int = 512, chat_template: str | None = None) -> Path:
    """The checkpoint's directory; with ``chat_template`` a tokenizer_config.json carries it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**BYTE_LLAMA, "max_position_embeddings": max_position_embeddings}
    (folder / "config.json").write_text(json.dumps(config))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return folder


def write_random_adapter(model_dir: Path, folder: Path) -> Path:
    """A rank-4 peft LoRA on q and v of the model in ``model_dir``, with random (non-zero) A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    model.save_pretrained(folder)
    return folder
