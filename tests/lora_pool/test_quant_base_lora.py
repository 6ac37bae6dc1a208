"""LoRA over a quantized base: the base's projections quantized at load (``--quantize``), adapters in
float through the batched LoRA path as over a float base, and every request's logits those of peft's
PeftModel over the dequantized base (the quantized weights' exact values): within 1e-3 where the
quantized projections are computed exactly (their fallback), within the kernels' activation rounding
on the kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import engine.model
import engine.quant_linear
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import load_model
from engine.request import EngineRequest, SamplingParams
from engine.quant_linear import quantize_weight
from engine.runner import ModelRunner
from lora_pool import BaseShapes, LoraPool
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, chunk, finish_step
from tests.lora_pool.test_engine_matches_peft import (  # noqa: F401 (fixtures)
    REQUESTS,
    adapter_dirs,
    base_dir,
    peft_greedy,
    peft_last_logits,
    prompts,
)

PROJ_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Activations rounded to int8 (per 16 values for Q4_0 and Q8_0 on the packed kernels), three layers deep:
# the largest of ten (format, adapter) draws, each the worst logit of a random tiny model. Measured on a
# Zen 4 box: 0.04-0.10 of the spread with x per 16, 0.03-0.09 per 32 (the worst case moving between
# adapters), so the bound keeps a little room above both.
KERNEL_RTOL = 0.12
# The AMX panel path (many rows, csrc/quant_dequant_panel.cpp) rounds the weights too, each value and each
# activation to bfloat16's 8 significant bits, three layers deep.
PANEL_RTOL = 0.15


@pytest.fixture
def exact_fallback(monkeypatch):
    """The quantized projections on their exact fallback, as where the kernels did not build: the model
    asks too (it fixes the kernels' switches at load), whatever test ran before."""
    for module in (engine.quant_linear, engine.model):
        monkeypatch.setattr(module, "quant_kernels_present", lambda: False)


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def peft_models(base_dir, adapter_dirs, kind, tmp_path_factory):  # noqa: F811
    """Adapter (None for the base) -> peft's model over the base whose projections hold the values
    quantize_weight gives them."""
    dequantized = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in dequantized.named_parameters():
            if name.endswith(tuple(f"{p}.weight" for p in PROJ_SUFFIXES)):
                param.copy_(quantize_weight(param.detach().t(), kind).dense().t())
    folder: Path = tmp_path_factory.mktemp(f"dequantized-{kind}")
    dequantized.save_pretrained(folder)
    models = {None: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()}
    for name, path in adapter_dirs.items():
        models[name] = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), path).eval()
    return models


def run_mixed_batch(base_dir: Path, adapter_dirs: dict, peft_models: dict, kind: str) -> list[tuple]:  # noqa: F811
    """Four adapters and base rows over three steps (prefills, then decodes): (ours, peft's) logits per sampled row."""
    loaded = load_model(str(base_dir), quantize=kind)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert {getattr(layer, p).form for layer in runner.model.layers for p in ("qkv", "o", "gate_up", "down")} == {
        "quant"}
    pool = LoraPool(BaseShapes.from_model_config(loaded.model_config), max_loras=4, max_cpu_loras=4,
                    max_lora_rank=16)
    for name, path in adapter_dirs.items():
        pool.register(name, path)
    blocks = BlockPool(64)
    seqs = [Sequence(f"r{i}", ids, adapter=name) for i, ((name, _), ids) in enumerate(zip(REQUESTS, prompts()))]
    pairs = []
    for step in range(3):
        plan = StepPlan([chunk(s, s.num_computed_tokens, s.num_tokens - s.num_computed_tokens, blocks, 4)
                         for s in seqs])
        logits = runner.execute(plan, pool.batch_for([(c.seq.adapter, c.num_tokens) for c in plan.chunks]))
        for c, row in zip([c for c in plan.chunks if c.samples], logits):
            pairs.append((c.seq.adapter, row, peft_last_logits(peft_models[c.seq.adapter], c.seq.all_token_ids[:c.end])))
        finish_step(plan, logits)
    return pairs


def test_adapters_over_a_quantized_base_match_peft_over_its_dequantized_values(base_dir, adapter_dirs,  # noqa: F811
                                                                               peft_models, kind, exact_fallback):
    for adapter, ours, expected in run_mixed_batch(base_dir, adapter_dirs, peft_models, kind):
        assert (ours - expected).abs().max().item() < 1e-3, f"adapter {adapter}"
    # The adapters change the model, so the comparison can fail.
    ids = prompts()[0]
    assert (peft_last_logits(peft_models[None], ids) - peft_last_logits(peft_models["attn_r4"], ids)).abs().max() > 0.1


@pytest.mark.parametrize("panel_rows", ["off", "1"], ids=["int8", "amx_panels"])
def test_adapters_over_a_quantized_base_on_the_kernels_stay_within_the_activation_rounding(
        base_dir, adapter_dirs, peft_models, kind, panel_rows, monkeypatch):  # noqa: F811
    assert engine.quant_linear.quant_kernels_present()
    if panel_rows != "off" and not torch.ops.tiergate.quant_panel_supported():
        pytest.skip("this CPU does not run oneDNN's bfloat16 micro-kernel (no AMX): the panel path is never taken")
    monkeypatch.setenv("TIERGATE_QUANT_PANEL_ROWS", panel_rows)
    rtol = KERNEL_RTOL if panel_rows == "off" else PANEL_RTOL
    for adapter, ours, expected in run_mixed_batch(base_dir, adapter_dirs, peft_models, kind):
        spread = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < rtol * spread, f"adapter {adapter}"


def test_an_engine_configured_to_quantize_serves_adapters_with_peft_greedy_tokens(base_dir, adapter_dirs,  # noqa: F811
                                                                                  peft_models, kind, exact_fallback):
    config = EngineConfig(model=str(base_dir), quantize=kind, max_loras=4, max_cpu_loras=4, max_lora_rank=16,
                          num_kv_blocks=128, block_size=4)
    with Engine(config) as served:
        assert served.runner.model.layers[0].qkv.form == "quant"
        for name, path in adapter_dirs.items():
            served.register_adapter(name, str(path))
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        results = served.generate_batch_sync([EngineRequest(f"r{i}", ids, params, adapter=name)
                                              for i, ((name, _), ids) in enumerate(zip(REQUESTS, prompts()))])
    for (name, _), ids, (_, tokens) in zip(REQUESTS, prompts(), results):
        assert tokens == peft_greedy(peft_models[name], ids, 5)[0], f"adapter {name}"


@pytest.mark.parametrize("quantize, lora_dtype, expected", [
    ("q8_0", None, torch.bfloat16),  # a quantized model: adapters in bfloat16 on the kernel
    (None, None, torch.float32),  # the exact path keeps peft's values
    ("q8_0", "float32", torch.float32),  # asked for
])
def test_an_engine_keeps_adapters_in_bfloat16_over_a_quantized_model_unless_asked_otherwise(
        base_dir, quantize, lora_dtype, expected):  # noqa: F811
    config = EngineConfig(model=str(base_dir), quantize=quantize, lora_dtype=lora_dtype, max_loras=2,
                          max_cpu_loras=2, num_kv_blocks=16, block_size=4)
    with Engine(config) as served:
        assert served.lora_pool.stack_dtype == expected and served.lora_pool.cpu_kernel


def test_an_engine_refuses_an_unknown_adapter_dtype():
    with pytest.raises(ValueError, match="lora_dtype"):
        EngineConfig(lora_dtype="float16")
