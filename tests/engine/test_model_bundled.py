"""The bundled SmolLM2-135M-Instruct (GGUF, dequantized once) runs natively and matches HF transformers."""

from __future__ import annotations

import torch

from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, chunk, finish_step

BLOCK_SIZE = 16


def test_bundled_model_greedy_tokens_and_logits_match_hf(bundled_model, assert_matches_hf):
    loaded = bundled_model
    assert loaded.model_config.num_layers == 30 and loaded.model_config.tie_word_embeddings
    assert loaded.tokenizer.id_to_token(loaded.eos_token_ids[0]) == "<|im_end|>"
    assert "<|im_start|>" in loaded.chat_template

    prompt = loaded.tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK_SIZE)
    ref = HFReference(loaded.path)  # HF's model on the safetensors HF itself dequantized from the GGUF
    pool = BlockPool(16)
    seq = Sequence("bundled", prompt)
    plan = StepPlan([chunk(seq, 0, len(prompt), pool, BLOCK_SIZE)])
    for _ in range(6):
        logits = runner.execute(plan)
        assert_matches_hf(ref, plan, logits)
        finish_step(plan, logits)
        plan = StepPlan([chunk(seq, seq.num_computed_tokens, 1, pool, BLOCK_SIZE)])

    with torch.no_grad():
        expected = ref.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert seq.output_token_ids == expected.tolist()
    assert "Paris" in loaded.tokenizer.decode(seq.output_token_ids)
