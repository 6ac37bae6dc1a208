"""A tiny Llama whose projections call LoraBatch.apply matches peft's PeftModel per request."""

from __future__ import annotations

import pytest
import torch
from tests.lora_pool.conftest import ALL_TARGETS, TINY, tiny_model
from peft import PeftModel
from torch import nn

from lora_pool import LoraPool

ADAPTERS = {
    "qv_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_r8_rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=ALL_TARGETS),
    "mlp_r2": dict(r=2, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "ko_r6_patterns": dict(r=6, lora_alpha=6, target_modules=["k_proj", "o_proj"], alpha_pattern={"o_proj": 3},
                           rank_pattern={"k_proj": 3}),
}
PROJ_PARENT = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
               "gate": "mlp", "up": "mlp", "down": "mlp"}


class LoraLinear(nn.Module):
    """A base projection followed by the step's LoRA update, as the engine's model does it."""

    def __init__(self, base: nn.Linear, layer: int, proj: str, step: dict):
        super().__init__()
        self.base, self.layer, self.proj, self.step = base, layer, proj, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.step["lora"] is not None:
            self.step["lora"].apply(self.layer, self.proj, x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]))
        return y


def with_lora_hooks(model: nn.Module) -> dict:
    step = {"lora": None}
    for layer, block in enumerate(model.model.layers):
        for proj, parent in PROJ_PARENT.items():
            module = getattr(block, parent)
            setattr(module, f"{proj}_proj", LoraLinear(getattr(module, f"{proj}_proj"), layer, proj, step))
    return step


@pytest.fixture
def adapters(adapter_dir):
    return {name: adapter_dir(name, seed=i + 10, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}


def peft_logits(adapter_path, tokens: torch.Tensor) -> torch.Tensor:
    model = tiny_model()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def run_step(pool, model, step, requests, tokens):
    step["lora"] = pool.batch_for([(name, tokens.shape[1]) for name in requests])
    with torch.no_grad():
        return model(tokens).logits


def test_mixed_batch_of_four_adapters_and_base_rows_matches_peft_per_request(adapters, shapes):
    pool = LoraPool(shapes, max_loras=4, max_cpu_loras=4, max_lora_rank=8)
    for name, path in adapters.items():
        pool.register(name, path)
    model = tiny_model()
    step = with_lora_hooks(model)
    requests = ["qv_r4", None, "all_r8_rslora", "mlp_r2", "qv_r4", "ko_r6_patterns", None]
    tokens = torch.randint(0, TINY["vocab_size"], (len(requests), 9), generator=torch.Generator().manual_seed(3))
    logits = run_step(pool, model, step, requests, tokens)
    for i, name in enumerate(requests):
        expected = peft_logits(adapters.get(name), tokens[i])
        torch.testing.assert_close(logits[i], expected, rtol=0, atol=1e-4)
    # the adapters really change the output, so the comparison above can fail
    assert not torch.allclose(logits[0], peft_logits(None, tokens[0]), atol=1e-2)


def test_steps_that_evict_slots_still_match_peft(adapters, shapes):
    pool = LoraPool(shapes, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        pool.register(name, path)
    model = tiny_model()
    step = with_lora_hooks(model)
    tokens = torch.randint(0, TINY["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(4))
    for requests in (["qv_r4", "mlp_r2", None], ["all_r8_rslora", None, "ko_r6_patterns"], ["mlp_r2", "qv_r4", "qv_r4"]):
        logits = run_step(pool, model, step, requests, tokens)
        for i, name in enumerate(requests):
            torch.testing.assert_close(logits[i], peft_logits(adapters.get(name), tokens[i]), rtol=0, atol=1e-4)
    assert pool.evictions >= 2
