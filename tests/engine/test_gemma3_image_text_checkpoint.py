"""Gemma 3's image-text checkpoints (4B and up) are served as their text model: the same logits as
transformers' Gemma3ForConditionalGeneration on text, with and without a peft adapter trained on it,
the vision tower's weights (and its adapter weights) left unread."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from engine.loader import load_model
from engine.runner import ModelRunner
from lora_pool import BaseShapes, LoraPool
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import TINY_CONFIGS, TINY_VOCAB, BlockPool, chunk, write_tiny_tokenizer
from tests.lora_pool.conftest import save_random_lora


@pytest.fixture(scope="module")
def image_text_dir(tmp_path_factory):
    """A tiny Gemma 3 image-text checkpoint whose text model is the tiny gemma3 of the family tests."""
    _, _, text = TINY_CONFIGS["gemma3"]
    text = dict(text, vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=TINY_VOCAB - 1, boi_token_index=TINY_VOCAB - 3,
                          eoi_token_index=TINY_VOCAB - 2)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms away from their zero start, so a norm loaded wrong shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    folder = tmp_path_factory.mktemp("gemma3-image-text")
    model.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


def test_an_image_text_checkpoint_is_served_with_its_text_models_logits(image_text_dir):
    loaded = load_model(str(image_text_dir))
    assert loaded.model_config.model_type == "gemma3_text" and loaded.model_config.local_rope_layers == (0, 2)
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 22)))  # longer than the window
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    reference = Gemma3ForConditionalGeneration.from_pretrained(image_text_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([seq.all_token_ids])).logits[0, -1].float()
    assert expected.abs().max() > 0.5
    assert (runner.execute(plan)[0] - expected).abs().max().item() < 1e-3


def test_an_adapter_trained_on_the_image_text_model_serves_its_text_layers(image_text_dir, tmp_path):
    """peft's names put the text layers under language_model, and q_proj and v_proj also name the
    vision tower's projections, whose adapter weights change nothing for text and are left unread."""
    def hf_model():
        return Gemma3ForConditionalGeneration.from_pretrained(image_text_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()

    adapter = save_random_lora(hf_model(), tmp_path / "adapter", seed=3, std=0.15, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    loaded = load_model(str(image_text_dir))
    pool = LoraPool(BaseShapes.from_model_config(loaded.model_config), max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    pool.register("tuned", adapter)
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(5, 22)), adapter="tuned")
    plan = StepPlan([chunk(seq, 0, seq.num_tokens, BlockPool(16), 4)])
    logits = runner.execute(plan, pool.batch_for([("tuned", seq.num_tokens)]))[0]
    reference = PeftModel.from_pretrained(hf_model(), adapter).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([seq.all_token_ids])).logits[0, -1].float()
        plain = hf_model()(torch.tensor([seq.all_token_ids])).logits[0, -1].float()
    assert (expected - plain).abs().max() > 0.1, "the adapter changes nothing: the test cannot fail"
    assert (logits - expected).abs().max().item() < 1e-3
