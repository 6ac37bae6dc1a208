"""The LoRA hook sees every projection with the right input and output columns.

A fake batch adds a dense low-rank delta to all rows, splitting the fused qkv and
gate/up calls into their projections; the result must equal HF's model with that
delta merged into the weights, which pins down the column order of the fused outputs.
"""

from __future__ import annotations

import torch

from engine.loader import load_model
from engine.lora_hook import FUSED_GROUPS, PROJECTIONS
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, HFReference, chunk, finish_step

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


class DenseLora:
    """Every row gets ``x @ A @ B`` for each (layer, projection) it holds."""

    def __init__(self, deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.deltas = deltas
        self.calls: list[tuple[int, str]] = []

    def apply(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        col = 0
        for proj in FUSED_GROUPS.get(name, (name,)):  # a group's outputs sit side by side in y
            self.calls.append((layer, proj))
            a, b = self.deltas[(layer, proj)]
            y[:, col: col + b.shape[1]] += x @ a @ b
            col += b.shape[1]
        assert col == y.shape[1], f"{name}: deltas cover {col} of y's {y.shape[1]} columns"


def test_lora_deltas_on_every_projection_equal_merged_hf_weights(tiny_model_dirs, assert_matches_hf):
    path = tiny_model_dirs["gqa_untied"]
    loaded = load_model(str(path))
    ref = HFReference(path)
    g = torch.Generator().manual_seed(0)
    deltas = {}
    for layer, hf_layer in enumerate(ref.model.model.layers):
        for proj, module_name in HF_MODULES.items():
            module = hf_layer.get_submodule(module_name)
            a = torch.randn(module.in_features, 2, generator=g) * 0.1
            b = torch.randn(2, module.out_features, generator=g) * 0.1
            deltas[(layer, proj)] = (a, b)
            module.weight.data += (a @ b).T
    lora = DenseLora(deltas)

    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    pool = BlockPool(32)
    one, two = Sequence("one", list(range(5, 18))), Sequence("two", list(range(40, 47)))
    plan = StepPlan([chunk(one, 0, 13, pool, 4), chunk(two, 0, 7, pool, 4)])
    for _ in range(3):
        lora.calls.clear()
        logits = runner.execute(plan, lora=lora)
        assert_matches_hf(ref, plan, logits)
        finish_step(plan, logits)
        plan = StepPlan([chunk(s, s.num_computed_tokens, 1, pool, 4) for s in (one, two)])
    assert lora.calls == [(layer, p) for layer in range(loaded.model_config.num_layers) for p in PROJECTIONS]
